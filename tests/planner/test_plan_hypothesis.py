"""Random clusters, models and workloads, extreme numbers included: planning ends in a plan or
a one-paragraph user error (exit 2), never a traceback, and within its budget's reach."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.cli import main
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.planner.modelspec import MODEL_PRESETS

counts = st.one_of(st.integers(1, 64), st.sampled_from([1, 10**6, 10**9, 2**40]))
lengths = st.one_of(
    st.integers(1, 4096).map(str),
    st.builds(
        lambda median, sigma, top: f"{{kind: lognormal, median: {median}, sigma: {sigma}, max: {top}}}",
        st.integers(1, 32000),
        st.floats(0, 3),
        st.integers(1, 10**6),
    ),
    st.builds(
        lambda w: f"{{kind: histogram, lengths: [16, 4096], weights: [{w}, 1.0]}}",
        st.sampled_from(["1.0e308", "1.0e-300", "3.0"]),
    ),
)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    devices=st.sampled_from([1, 2, 3, 8, 12, 16, 64, 128, 1000]),
    hardware=st.sampled_from(sorted(HARDWARE_PRESETS)),
    model=st.sampled_from(sorted(MODEL_PRESETS)),
    graph=st.sampled_from(["grpo", "ppo", "graphs/two_agent.py", "graphs/dapo.py"]),
    prompts=counts,
    samples=counts,
    prompt_length=counts,
    response=lengths,
)
def test_random_inputs_plan_or_fail_as_user_errors(
    tmp_path_factory, devices, hardware, model, graph, prompts, samples, prompt_length, response
):
    folder = tmp_path_factory.mktemp("w")
    workload = folder / "w.yaml"
    workload.write_text(
        f"prompts_per_step: {prompts}\nsamples_per_prompt: {samples}\nprompt_length: {prompt_length}\n"
        f"response_length: {response}\n"
    )
    argv = ["plan", graph, "--cluster", f"{devices}x{hardware}", "--model", model, "--workload", str(workload)]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*argv, "--budget", "0.3"])
    assert code in (0, 2), err.getvalue()
    assert "Traceback" not in err.getvalue() and "crashed" not in err.getvalue(), err.getvalue()
