"""Offload (`parallelize.offload`): optimizer states in host memory between steps."""

from __future__ import annotations

import torch

from flowrl.backends.local.parallelize import offload


def _stepped() -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    return p, opt


def test_moving_the_states_moves_every_tensor_but_the_step_count():
    _, opt = _stepped()
    step = next(iter(opt.state.values()))["step"]
    offload.move_states(opt, torch.device("meta"))
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
    assert state["step"] is step


def test_a_host_step_takes_the_same_step_and_leaves_the_states_on_the_host():
    p, opt = _stepped()
    q, ref = _stepped()
    p.grad = q.grad = torch.full((3,), 0.5)
    offload.host_step(opt, torch.device("cpu"))
    ref.step()
    torch.testing.assert_close(p, q)
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    assert offload.fsdp_policy(torch.device("cpu")).pin_memory is False
