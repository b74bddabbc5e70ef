"""Pipeline parallelism in the torch engine (flowrl/backends/local/parallelize/pipeline.py,
flowrl/backends/local/staged.py): a model cut into pp=2 stages over two gloo processes -- by the GPipe,
1F1B and interleaved (2 stages per rank, 4 layers) schedules, and with an LM head tied to the embeddings
-- computes what one process computes: the forward passes (log-probs, values, scores), and a train step
for every built-in loss and every way a loss aggregates (loss, gradient norm and update); a checkpoint
of it resumes bit for bit. With four
processes, pp2 x dp2 (FSDP2 over each stage) and pp2 x tp2 (DTensor slices inside each stage) do too.
Processes of this machine, forked by a fork server (no Ray)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from flowrl.algorithms.ops import LOSSES

WORKER = Path(__file__).with_name("pipeline_worker.py")
sys.path.insert(0, str(WORKER.parent))
from pipeline_worker import LAYOUTS, LOSS_CASES  # noqa: E402

pytestmark = pytest.mark.slow


# what every worker imports, imported once by the fork server that forks them (a fresh interpreter per
# rank spent most of this module's time importing torch and transformers)
PRELOAD = ["torch", "torch.distributed.pipelining", "transformers", "transformers.models.llama.modeling_llama",
           "flowrl.api", "flowrl.backends.local.factories", "pipeline_worker"]  # fmt: skip


def _spawn(tmp_path_factory, world: int) -> dict:
    """Every layout's comparison for ``world`` ranks, from one group of processes forked by a fork server
    that imported the workers' modules once (each rank one torch thread: they share this machine's cores)."""
    import multiprocessing

    import pipeline_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("pp") / "result.json"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect where this process's fork server already runs
    procs = [ctx.Process(target=pipeline_worker.run, args=(rank, port, str(out), world)) for rank in range(world)]
    with pytest.MonkeyPatch.context() as env:  # the fork server, if this starts it, imports torch at one thread
        env.setenv("OMP_NUM_THREADS", "1")
        for p in procs:
            p.start()
    for p in procs:
        p.join(timeout=900)
    for p in procs:  # a rank left waiting on one that failed
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text()[-3000:] for f in sorted(out.parent.glob("rank-*.err"))]
    assert all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _spawn(tmp_path_factory, 4)


LAYOUT_NAMES = [(2, n) for n in LAYOUTS[2]] + [(4, n) for n in LAYOUTS[4]]


@pytest.fixture(params=LAYOUT_NAMES, ids=[n for _, n in LAYOUT_NAMES])
def layout(request):
    world, name = request.param
    return request.getfixturevalue("two" if world == 2 else "four")[name]


def test_every_built_in_loss_is_compared():
    # a loss reading rows in groups (preference pairs) is never staged: the planner gives its model no stages
    staged = {name for name, (_, meta) in LOSSES.items() if meta.get("rows", "each") == "each"}
    assert staged <= {name for name, _, _ in LOSS_CASES} and "bradley_terry" not in staged


def test_the_stages_export_the_whole_model(layout):
    assert layout["same_start"]  # built from the same seed; the export gathers every stage (and dp/tp piece)


def test_pipelined_forward_passes_equal_the_one_process_passes(layout):
    forward = layout["forward"]
    assert forward["logprobs"] < 1e-5 and forward["values"] < 1e-5 and forward["scores"] < 1e-5, forward


@pytest.mark.parametrize("case", [f"{name} {options}" for name, options, _ in LOSS_CASES])
def test_a_pipelined_train_step_equals_the_one_process_step(layout, case):
    """Loss and gradient norm to fp32 rounding (over dp ranks the loss stat is a rank's own rows', as
    without stages); the update too -- with tp slices, up to AdamW's normalisation of near-zero gradients
    (a weight moves by about lr whichever way a tiny gradient rounds; the tp tests allow 10 % of the largest
    move, the others 1 %)."""
    got = layout["losses"][case]
    (l1, l2), (n1, n2) = got["loss"], got["grad_norm"]
    if "dp" not in layout["layout"]:
        assert abs(l1 - l2) < 1e-5 * max(1.0, abs(l1)), got
    assert abs(n1 - n2) < 1e-5 * max(1.0, n1), got
    assert got["moved"] > 1e-4  # the step did something
    # without tp slices within 1% of the largest move: a schedule sums gradients in another order, and AdamW
    # scales a near-zero gradient's rounding up to a step (measured: 1.3e-5 of a 0.004 move, interleaved ppo)
    tolerance = 0.1 * got["moved"] if "tp" in layout["layout"] else 0.01 * got["moved"]
    assert got["diff"] < tolerance, got
    assert {"loss", "grad_norm", "pad_frac"} <= set(got["stats"])  # the last stage's stats reach every rank
    assert 0.0 <= got["bubble"] < 1.0  # measured: the share of the step this rank waited on the other stage


def test_a_tied_heads_two_copies_stay_equal_bit_for_bit(two):
    """The first stage's embedding and the last stage's copy of it after seven train steps (the layout's
    steps above, equal to the one-process steps of the tied model)."""
    assert two["tied"]["tied_copies_equal"]


@pytest.mark.parametrize("name", ["resume", "resume-tied"])
def test_a_resumed_pp2_model_continues_bit_for_bit(two, name):
    """A tied head's checkpoint stores the weight once (the embedding's name), its config still tied; in
    one process it resumes too (weights and optimizer state: the next step is the pp=2 model's)."""
    resumed = two[name]
    tied = name == "resume-tied"
    assert resumed == {
        "version": 1,
        "restored": True,
        "next_step": True,
        "one_process": True,
        "head_stored": not tied,
        "tie_word_embeddings": tied,
    }


def test_a_tied_heads_dp2_checkpoint_resumes_in_pp2_with_both_copies_equal(two):
    """The dp=2 checkpoint holds the shared weight's optimizer state once; the head's copy takes it too."""
    assert two["resume-from-dp2-tied"] == {"next_step": True, "copies_equal": True}


def test_a_bf16_pp2_step_counts_only_its_micro_batches(two):
    """The sampler's and the trainer's log-probs agree bit for bit on this CPU in bfloat16 (the same torch
    kernels: decode with a KV cache and the full forward), in one process and over pp=2 stages alike; the
    pp=2 step's loss and padding are its micro-batches' only (torch's shape inference calls the loss once
    more, on placeholder activations, before them)."""
    whole, staged = two["bf16"]["whole"], two["bf16"]["staged"]
    assert staged["logprob_gap"] == whole["logprob_gap"] and staged["logprob_gap_max"] == whole["logprob_gap_max"]
    assert staged["pad_frac"] == pytest.approx(whole["pad_frac"], abs=1e-9), (whole, staged)
    assert staged["loss"] == pytest.approx(whole["loss"], rel=2e-2, abs=1e-3), (whole, staged)
    assert staged["grad_norm"] == pytest.approx(whole["grad_norm"], rel=5e-2), (whole, staged)
