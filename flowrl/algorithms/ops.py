"""Graph-facing wrappers around the tensor math: compute functions, losses, reward functions.

Each wrapper reads the keys its node declares (by their conventional names), calls the plain
tensor functions in `advantages` / `losses`, and returns the keys it produces, with the
metrics it owns (``kl`` where it sees the reference, ``exact`` for task rewards). What each
one needs and gives is registered with it, so the planner's `resolve` pass can check a
graph's keys before anything runs.

Every CLI call registers these functions, and planning reads them; neither needs torch, so each
function imports torch and the tensor math when it runs (tests/test_cli_imports.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from flowrl.contract.data import Prompt
from flowrl.specs import AlgoConfig

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.contract.data import Sequences
else:  # the planner resolves these annotations (typing.get_type_hints) to check node options, without torch
    Tensor = Sequences = Any

Batch = dict[str, Any]


def _token_rewards(
    inputs: Batch, seqs: Sequences, algo: AlgoConfig, kl_coef: float | None
) -> tuple[Tensor, dict[str, float]]:
    """Sequence reward on the last token, minus a per-token KL penalty when both log-probs are read.

    r_t = score * [t = last] - beta * (log pi_old(a_t) - log pi_ref(a_t))

    Metric ``kl``: the masked mean of the k3 estimate of KL(pi_old || ref) when both are read.
    """
    from flowrl.algorithms import advantages as adv
    from flowrl.algorithms import losses

    mask = seqs.sampled_mask
    rewards = adv.sequence_to_token_rewards(inputs["rewards"].float(), mask)
    metrics: dict[str, float] = {}
    if "old_logprobs" in inputs and "ref_logprobs" in inputs:
        old, ref = inputs["old_logprobs"], inputs["ref_logprobs"]
        metrics["kl"] = round(float(adv.masked_mean(losses.kl_penalty(old, ref, "k3"), mask)), 6)
        beta = algo.kl_coef if kl_coef is None else kl_coef
        if beta:
            rewards = rewards - beta * losses.kl_penalty(old, ref, "k1") * mask
    return rewards, metrics


# ---------------------------------------------------------------- compute functions


def gae_op(
    inputs: Batch, algo: AlgoConfig, *, kl_coef: float | None = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """PPO: GAE(gamma, lambda) over token rewards with the KL penalty in the reward."""
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'gae'")
    mask = seqs.sampled_mask
    values = inputs["values"].float() * mask
    rewards, metrics = _token_rewards(inputs, seqs, algo, kl_coef)
    advantages, returns = adv.gae(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
    if algo.whiten_advantages:
        advantages = adv.masked_whiten(advantages, mask)
    return {"advantages": advantages, "returns": returns}, metrics


def grpo_op(inputs: Batch, algo: AlgoConfig, *, eps: float = 1e-6, scale: bool = True) -> dict[str, Tensor]:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), the same for every token."""
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'grpo'")
    a = adv.grpo(inputs["rewards"].float(), seqs.prompt_index, eps=eps, scale=scale)
    return {"advantages": adv.broadcast_to_tokens(a, seqs.sampled_mask)}


def rloo_op(inputs: Batch, algo: AlgoConfig) -> dict[str, Tensor]:
    """RLOO: A_i = r_i - mean of the other samples of the same prompt."""
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'rloo'")
    a = adv.rloo(inputs["rewards"].float(), seqs.prompt_index)
    return {"advantages": adv.broadcast_to_tokens(a, seqs.sampled_mask)}


def remax_op(inputs: Batch, algo: AlgoConfig) -> dict[str, Tensor]:
    """ReMax: A_i = r_i - r(greedy response of the same prompt), scaled by the batch std.

    Scaling only (no mean shift, which would undo the greedy baseline) keeps the step size
    independent of the reward scale: early on every r_i - b_i is tiny.
    """
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'remax'")
    baseline = inputs["baseline_rewards"].float()[seqs.prompt_index]
    a = adv.broadcast_to_tokens(adv.remax(inputs["rewards"].float(), baseline), seqs.sampled_mask)
    if algo.whiten_advantages:
        a = adv.masked_whiten(a, seqs.sampled_mask, shift_mean=False)
    return {"advantages": a}


def reinforce_pp_op(
    inputs: Batch, algo: AlgoConfig, *, kl_coef: float | None = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """REINFORCE++: discounted token returns (KL in the reward), whitened over the batch."""
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'reinforce_pp'")
    rewards, metrics = _token_rewards(inputs, seqs, algo, kl_coef)
    return {"advantages": adv.reinforce_pp(rewards, seqs.sampled_mask, gamma=algo.gamma)}, metrics


def overlong_op(inputs: Batch, algo: AlgoConfig, *, max_length: int = 16, cache: int = 4) -> dict[str, Tensor]:
    """DAPO's soft overlong punishment: shaped = r + penalty(L), with L a response's sampled tokens,
    penalty 0 up to max_length - cache, falling linearly to -1 at max_length, -1 beyond."""
    import torch

    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'overlong'")
    length = seqs.sampled_mask.sum(-1).float()
    start = float(max_length - cache)
    penalty = torch.clamp((start - length) / max(cache, 1), min=-1.0, max=0.0)
    return {"shaped": inputs["rewards"].float() + penalty}


def lagrangian_op(inputs: Batch, algo: AlgoConfig) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Safe-RLHF's policy advantage: A = (A_reward - lambda * A_cost) / (1 + lambda), with lambda the
    Lagrange multiplier (graph state)."""
    lam = float(inputs["multiplier"])
    advantages = (inputs["reward_advantages"].float() - lam * inputs["cost_advantages"].float()) / (1.0 + lam)
    return {"advantages": advantages}, {}


def lagrange_update_op(
    inputs: Batch, algo: AlgoConfig, *, budget: float = 0.0, lr: float = 0.05
) -> tuple[dict[str, Any], dict[str, float]]:
    """The Lagrange multiplier's dual ascent step: lambda <- max(0, lambda + lr * (mean cost - budget));
    it grows while the expected cost exceeds the budget and shrinks once it is met."""
    cost = float(inputs["costs"].float().mean())
    lam = max(0.0, float(inputs["multiplier"]) + lr * (cost - budget))
    return {"multiplier": lam}, {"cost": round(cost, 6), "violation": round(cost - budget, 6)}


def group_mean_op(inputs: Batch, algo: AlgoConfig) -> dict[str, Tensor]:
    """Per-prompt mean of per-row values: ``values`` of one generate node's responses, averaged over
    the samples of each of its prompts (``prompts``): one value per prompt, e.g. a solver's mean
    reward handed back to the proposer whose response made the prompt."""
    import torch

    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'group_mean'")
    groups = len(inputs["prompts"])
    values = inputs["values"].float()
    sums = torch.zeros(groups).index_add(0, seqs.prompt_index, values)
    counts = torch.zeros(groups).index_add(0, seqs.prompt_index, torch.ones_like(values))
    return {"means": sums / counts.clamp_min(1.0)}


def followup_prompts_op(inputs: Batch, algo: AlgoConfig, *, sep: str = "") -> dict[str, Any]:
    """New prompts from responses: each response appended to the prompt it answered (then
    ``sep``), with that prompt's reference answer; one prompt per response, e.g. a proposer's hint
    that a second policy reads."""
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'followup_prompts'")
    prompts = inputs["prompts"]
    out = [
        Prompt(text=f"{prompts[i].text}{text}{sep}", answer=prompts[i].answer)
        for i, text in zip(seqs.prompt_index.tolist(), seqs.texts)
    ]
    return {"followups": out}


def judge_prompts_op(inputs: Batch, algo: AlgoConfig, *, template: str = "{prompt}{response}") -> dict[str, Any]:
    """Prompts for a judge model, one per response: ``template`` filled with ``{prompt}`` (the
    question's text), ``{response}`` (its final turn, for an episode) and ``{answer}`` (the reference).
    The prompt carries the response's number in ``meta["row"]``."""
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'judge_prompts'")
    prompts = inputs["prompts"]
    out = []
    for row, (i, text) in enumerate(zip(seqs.prompt_index.tolist(), seqs.reward_texts())):
        p = prompts[i]
        filled = template.format(prompt=p.text, response=getattr(text, "final", text), answer=p.answer)
        out.append(Prompt(text=filled, answer=p.answer, meta={"row": row}))
    return {"judge_prompts": out}


def judge_scores_op(
    inputs: Batch, algo: AlgoConfig, *, pattern: str = r"(-?\d+(?:\.\d+)?)", scale: float = 1.0, default: float = 0.0
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Scores parsed from a judge's verdicts (one per response, in the responses' order): the first
    match of ``pattern``'s first group as a number, divided by ``scale``; ``default`` where none
    matches. Metrics: ``reward`` (their mean: the run's headline reward) and ``unparsed`` (verdicts without a score)."""
    import re

    import torch

    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "compute function 'judge_scores'")
    found = re.compile(pattern)
    order = torch.argsort(seqs.prompt_index, stable=True).tolist()  # verdict k answers judge prompt k
    scores, unparsed = [], 0
    for k in order:
        match = found.search(seqs.texts[k])
        try:
            scores.append(float(match.group(1)) / scale if match else default)
        except (ValueError, IndexError):
            scores.append(default)
            match = None
        unparsed += match is None
    values = torch.tensor(scores, dtype=torch.float32)
    return {"scores": values}, {
        "reward": round(float(values.mean()), 6) if len(values) else 0.0,
        "unparsed": unparsed,
    }


def weighted_sum_op(
    inputs: Batch, algo: AlgoConfig, *, weights: dict[str, float] | None = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Several rewards as one: rewards = sum_k weights[k] * inputs[k], over every key the node reads
    (responses, found by their type, excepted: read them to have the rows checked). ``weights``
    names exactly those keys; each value is one number per response (or per token, all of one shape).
    Metric ``reward``: the mean of the sum (each part's reward node reports its own)."""
    import torch

    from flowrl.contract.data import Sequences
    from flowrl.errors import GraphError

    parts = {k: v for k, v in inputs.items() if not isinstance(v, Sequences)}
    if not weights:
        raise GraphError(
            "compute function 'weighted_sum' needs the option weights={KEY: WEIGHT} naming each key it reads "
            f"({', '.join(sorted(parts)) or 'none'})."
        )
    missing, extra = sorted(set(parts) - set(weights)), sorted(set(weights) - set(parts))
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"no weight for key {', '.join(map(repr, missing))}, which it reads")
        if extra:
            problems.append(f"a weight for key {', '.join(map(repr, extra))}, which it does not read")
        problem = "; ".join(problems)
        raise GraphError(
            f"compute function 'weighted_sum': {problem}. Its weights must name exactly the keys it reads "
            f"({', '.join(sorted(parts)) or 'none'})."
        )
    total: Tensor | None = None
    for key in sorted(parts):  # a fixed order: the sum is the same bits on every run
        value = torch.as_tensor(parts[key]).float()
        if total is not None and value.shape != total.shape:
            raise GraphError(
                f"compute function 'weighted_sum': key '{key}' has shape {list(value.shape)}, the others "
                f"{list(total.shape)}; weighted keys must have one shape (one value per response, or per token)."
            )
        term = float(weights[key]) * value
        total = term if total is None else total + term
    assert total is not None
    return {"rewards": total}, {"reward": round(float(total.mean()), 6) if total.numel() else 0.0}


# ---------------------------------------------------------------- filters


def nonconstant_filter(inputs: Batch, algo: AlgoConfig, *, min_spread: float = 1e-6) -> Tensor:
    """DAPO's dynamic sampling: keep the groups whose rewards are not all equal (all-correct or
    all-wrong groups have zero advantage and only dilute the batch)."""
    import torch

    from flowrl.contract.data import sequences_in

    seqs = sequences_in(inputs, "filter 'nonconstant'")
    rewards = inputs["rewards"].float()
    groups = int(seqs.prompt_index.max()) + 1 if len(seqs) else 0
    high = torch.full((groups,), -float("inf")).scatter_reduce(0, seqs.prompt_index, rewards, "amax")
    low = torch.full((groups,), float("inf")).scatter_reduce(0, seqs.prompt_index, rewards, "amin")
    return (high - low) > min_spread


def threshold_filter(inputs: Batch, algo: AlgoConfig, *, min_reward: float = 1.0) -> Tensor:
    """Rejection sampling: keep the responses whose reward is at least ``min_reward`` (one bool
    per response; with ``by_row`` the node keeps single rows)."""
    return inputs["rewards"].float() >= min_reward


# ---------------------------------------------------------------- losses


def mismatch_settings(algo: AlgoConfig) -> tuple[Any, ...]:
    """The sampler/trainer mismatch correction's mode and bounds, as `flowrl.algorithms.losses` takes them."""
    return (
        algo.mismatch, algo.mismatch_cap, algo.mismatch_low, algo.mismatch_high, algo.mismatch_seq_low,
        algo.mismatch_seq_high,
    )  # fmt: skip


def ppo_loss(logprobs: Tensor, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (clip-higher, dual-clip) + beta * KL(pi || ref) when the node reads ref_logprobs (metric ``kl``);
    tokens sampled by older weights weigh pi_prox / pi_behav (``algo.is_correction``, decoupled PPO), and the
    others are corrected for the sampler/trainer mismatch (``algo.mismatch``: TIS, IcePop, sequence masking;
    `flowrl.algorithms.losses.mismatch_weights`). Both terms aggregate by ``algo.loss_agg`` (token-mean,
    seq-mean-token-mean, or Dr. GRPO's seq-mean-token-sum-norm over ``algo.loss_norm``)."""
    from flowrl.algorithms import losses
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(batch, "loss 'ppo'")
    mask = seqs.sampled_mask
    weights, is_stats = None, {}
    policy_version = getattr(batch, "policy_version", None)  # a train step's StepBatch carries it
    stale = None
    if seqs.logprobs is not None and seqs.versions is not None and policy_version is not None:
        weights, is_stats = losses.behaviour_weights(
            batch["old_logprobs"],
            seqs.logprobs,
            seqs.versions,
            int(policy_version),
            mask,
            algo.is_correction,
            algo.is_cap,
        )
        stale = seqs.versions.to(mask.device) != int(policy_version)
    if seqs.logprobs is not None:  # the sampler's log-probs: its mismatch with the trainer is measurable
        weights, mismatch_stats = losses.mismatch_weights(
            batch["old_logprobs"],
            seqs.logprobs,
            mask,
            *mismatch_settings(algo),
            stale=stale,
            stale_weights=weights,
        )
        is_stats.update(mismatch_stats)
    loss, stats = losses.ppo_policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        weights=weights,
        agg=algo.loss_agg,
        norm=algo.loss_norm,
    )
    stats.update(is_stats)
    if "ref_logprobs" in batch:
        kl_tok = losses.kl_penalty(logprobs, batch["ref_logprobs"], algo.kl_estimator)
        kl = losses.aggregate(kl_tok, mask, algo.loss_agg, algo.loss_norm)
        stats["kl"] = float(kl.detach())
        if algo.kl_coef:
            loss = loss + algo.kl_coef * kl
    return loss, stats


def gspo_loss(logprobs: Tensor, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al., 2025): PPO-clip on the sequence-level ratio exp(mean_t(log pi - log pi_old)),
    one per response, with the sequence's advantage (its tokens' mean); a mean over responses (metric
    ``clipfrac``: the fraction of responses whose clipped term was the larger, i.e. clipping changed
    the loss). With the sampler's log-probs, each response weighs by its geometric-mean sampler/trainer
    ratio as ``algo.mismatch`` says (`flowrl.algorithms.losses.sequence_mismatch_weights`)."""
    import torch

    from flowrl.algorithms import losses
    from flowrl.contract.data import sequences_in

    seqs = sequences_in(batch, "loss 'gspo'")
    mask = seqs.sampled_mask
    tokens = mask.sum(-1).clamp_min(1.0)
    valid, zero = mask.bool(), torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # padding's values (even NaN) reach neither the means nor the gradient
    log_ratio = torch.where(valid, logprobs - batch["old_logprobs"], zero).sum(-1) / tokens
    advantages = torch.where(valid, torch.broadcast_to(batch["advantages"], valid.shape), zero).sum(-1) / tokens
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high)
    pg = torch.maximum(pg1, pg2)
    mismatch_stats: dict[str, float] = {}
    if seqs.logprobs is not None:
        weights, mismatch_stats = losses.sequence_mismatch_weights(
            batch["old_logprobs"],
            seqs.logprobs,
            mask,
            *mismatch_settings(algo),
        )
        pg = pg * weights.to(pg.dtype)
    with torch.no_grad():
        stats = {
            "clipfrac": float((pg2 > pg1).float().mean()) if len(ratio) else 0.0,
            "ratio_mean": float(ratio.mean()) if len(ratio) else 1.0,
            **mismatch_stats,
        }
    return pg.mean(), stats


def sft_loss(
    logprobs: Tensor, batch: Batch, algo: AlgoConfig, *, scale: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning on the batch's responses: scale * token-mean of -log pi(token)
    (rejection-sampling SFT trains it on the responses a filter kept)."""
    from flowrl.algorithms import advantages as adv
    from flowrl.contract.data import sequences_in

    nll = adv.masked_mean(-logprobs, sequences_in(batch, "loss 'sft'").sampled_mask)
    return scale * nll, {"nll": float(nll.detach())}


def sequence_logprobs(logprobs: Tensor, seqs: Sequences) -> Tensor:
    """[B] each row's summed log-prob of its trained tokens (the response's ``sampled_mask``)."""
    return (logprobs * seqs.sampled_mask.to(logprobs.dtype)).sum(-1)


def dpo_loss(
    logprobs: Tensor,
    batch: Batch,
    algo: AlgoConfig,
    *,
    beta: Annotated[float, Meta(gt=0)] = 0.1,
    label_smoothing: Annotated[float, Meta(ge=0, lt=0.5)] = 0.0,
    loss_type: Literal["sigmoid", "robust", "ipo"] = "sigmoid",
) -> tuple[Tensor, dict[str, float]]:
    """DPO on preference pairs (rows 2i chosen, 2i+1 rejected; `flowrl.algorithms.losses.dpo_loss`): the
    policy's and the reference's (``ref_logprobs``) summed log-probs of each response's trained tokens.
    ``beta``: the implicit reward's scale (the KL penalty's strength); ``label_smoothing``: the chance a
    label is flipped (cDPO; ``loss_type="robust"`` for its unbiased form); ``loss_type="ipo"``: IPO."""
    from flowrl.algorithms import losses
    from flowrl.contract.data import pair_rows, sequences_in

    seqs = sequences_in(batch, "loss 'dpo'")
    chosen, rejected = pair_rows(seqs, "loss 'dpo'")
    policy = sequence_logprobs(logprobs, seqs)
    ref = sequence_logprobs(batch["ref_logprobs"].to(logprobs.dtype), seqs)
    return losses.dpo_loss(
        policy[chosen],
        policy[rejected],
        ref[chosen],
        ref[rejected],
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
    )


def value_loss(values: Tensor, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss, scaled by vf_coef."""
    from flowrl.algorithms import losses
    from flowrl.contract.data import sequences_in

    mask = sequences_in(batch, "loss 'value'").sampled_mask
    loss, stats = losses.value_loss(values, batch["values"], batch["returns"], mask, clip=algo.vf_clip)
    return algo.vf_coef * loss, stats


def bradley_terry_op(
    scores: Tensor, batch: Batch, algo: AlgoConfig, *, margin: float = 0.0, center_coef: float = 0.0
) -> tuple[Tensor, dict[str, float]]:
    """A reward model's Bradley-Terry loss on preference pairs (rows ``2i`` chosen, ``2i + 1`` rejected,
    of a ``rows="pairs"`` source; `flowrl.contract.pair_rows`): -log sigmoid(r_chosen - r_rejected -
    margin), a mean over pairs, plus ``center_coef`` * mean((r_chosen + r_rejected)^2) (TRL's
    ``center_rewards_coefficient``). Metrics: ``pref_accuracy``, ``margin``, ``reward_chosen``,
    ``reward_rejected`` (`flowrl.algorithms.losses.bradley_terry_loss`), as DPO's."""
    from flowrl.algorithms import losses
    from flowrl.contract.data import pair_rows, sequences_in

    seqs = sequences_in(batch, "loss 'bradley_terry'")
    chosen, rejected = pair_rows(seqs, "loss 'bradley_terry'")
    return losses.bradley_terry_loss(scores[chosen], scores[rejected], margin=margin, center_coef=center_coef)


# ---------------------------------------------------------------- reward functions


def task_reward(prompts: list[Prompt], responses: list[str], task: Any) -> tuple[Tensor, dict[str, float]]:
    """The task's own rule-based score of each response (metric ``exact``: the fraction scoring 1).
    A task that scores with a verifier (`flowrl.tasks.verifiers`) also reports ``unparsed_answers``:
    how many of these responses' ground truths its verifier could not read (each scored 0)."""
    import torch

    from flowrl.tasks import verifiers

    before = verifiers.counts()
    scores = torch.tensor([task.score(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
    metrics = {"exact": round(float((scores == 1.0).float().mean()), 4) if len(scores) else 0.0}
    after = verifiers.counts()
    if after.calls > before.calls:
        metrics["unparsed_answers"] = after.unparsed - before.unparsed
    return scores, metrics


def episode_reward(
    prompts: list[Prompt], responses: list[str], task: Any, env_weight: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """A multi-turn episode's reward: the task's score of the model's final turn (not of the text the
    environment wrote, tool results included) plus ``env_weight`` times the rewards the environment
    gave its turns (`flowrl.contract.EpisodeText`). A single-turn response is scored whole. Metrics:
    ``final_exact`` (the fraction whose final answer scores 1) and ``env_reward`` (their mean)."""
    import torch

    finals = [getattr(r, "final", r) for r in responses]
    env = [float(getattr(r, "env_reward", 0.0)) for r in responses]
    scores = torch.tensor([task.score(p, f) for p, f in zip(prompts, finals)], dtype=torch.float32)
    n = max(len(responses), 1)
    metrics = {
        "final_exact": round(float((scores == 1.0).float().mean()), 4) if len(scores) else 0.0,
        "env_reward": round(sum(env) / n, 4),
    }
    return scores + env_weight * torch.tensor(env, dtype=torch.float32), metrics


def agent_reward(prompts: list[Prompt], responses: list[str], task: Any) -> tuple[Tensor, dict[str, float]]:
    """The reward each episode's agent returned (`flowrl.agents`: 0 when it returned None, the
    node's ``failure_reward`` when it failed), read from the episode's turns. Metric ``solved``: the
    fraction rewarded 1 or more."""
    import torch

    scores = torch.tensor([float(getattr(r, "env_reward", 0.0)) for r in responses], dtype=torch.float32)
    return scores, {"solved": round(float((scores >= 1.0).float().mean()), 4) if len(scores) else 0.0}


def verbosity_cost(prompts: list[Prompt], responses: list[str], task: Any) -> tuple[Tensor, dict[str, float]]:
    """A toy safety cost: 1 for a response longer than its reference answer (it says more than
    asked), else 0 (metric ``violations``: the fraction that cost)."""
    import torch

    costs = torch.tensor([float(len(r) > len(p.answer)) for p, r in zip(prompts, responses)])
    return costs, {"violations": round(float(costs.mean()), 4) if len(costs) else 0.0}


def code_reward(
    prompts: list[Prompt],
    responses: list[str],
    task: Any,
    template: str = "{response}",
    wall_s: float = 5.0,
    forgeable: bool = False,
    isolate: bool | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Model-written Python judged by its outputs (`flowrl.tasks.code_tests`): the fraction of
    ``prompt.meta["tests"]`` that pass. Tests are asserts (a list, or one per line) over calls of the
    functions the code defines -- ``assert f(2) == 4``, ``assert f(1) - f(0) == 1`` -- or stdin/stdout pairs
    (``{"input": ..., "output": ...}``). The code runs in the sandbox (`flowrl.tasks.sandbox`) and only
    returns values or output; the verdict is made here against expected values that never reach it, so the
    code cannot forge a pass. ``prompt.meta["entry_point"]`` names the function a test's ``candidate``
    stands for (HumanEval). ``forgeable=True`` instead execs each assert after the code in the sandboxed
    process (any assert form, for trusted code: code under test can forge that). The response (its fenced
    code block, when it has one) is put into ``template`` first, e.g. ``template="f = lambda x: {response}"``.
    In one process the code can read every test's arguments, and where one test's argument is another's
    expected value (an encoder and its decoder tested on the same pair) return it: so tests share a
    sandbox only where none expects what another hands the code (``isolate=True``: each test alone, a
    sandbox start each; ``isolate=False``: all in one, for trusted tests). The same code for the same
    tests runs once per call (a group's repeated answers). Metrics:
    ``all_passed`` (the fraction passing every test), ``sandbox_runs`` and ``timeouts``, ``crashed``,
    ``forged`` (runs that ended so)."""
    from flowrl.tasks import code_tests, sandbox

    limits = sandbox.Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)))
    scores, status = [], {"timeout": 0, "crashed": 0, "forged": 0, "output": 0}
    runs: dict[tuple[str, tuple[str, ...]], code_tests.Verdict] = {}  # a response repeated for its prompt runs once
    parsed: dict[tuple[Any, ...], list[code_tests.Test]] = {}
    for p, r in zip(prompts, responses):
        raw = p.meta.get("tests", [])
        raw = code_tests.split_tests(raw) if isinstance(raw, str) else list(raw)
        if not raw:
            raise ValueError(f"prompt {p.text[:60]!r} has no tests (meta 'tests'): the code reward has nothing to run")
        key = tuple(repr(t) for t in raw) + (repr(p.meta.get("entry_point")),)
        if not forgeable and key not in parsed:
            entry = p.meta.get("entry_point")
            rename = {"candidate": entry} if isinstance(entry, str) and entry.isidentifier() else None
            parsed[key] = code_tests.parse_tests(raw, where=f"prompt {p.text[:60]!r}", rename=rename)
        job = (template.format(response=sandbox.code_of(r)), key)
        if job not in runs:
            if forgeable:
                runs[job] = code_tests.run_asserts(job[0], [str(t) for t in raw], limits)
            else:
                runs[job] = code_tests.judge(job[0], parsed[key], limits, isolate=isolate)
            if runs[job].status in status:
                status[runs[job].status] += 1
        scores.append(sum(runs[job].passed) / len(raw))
    n = max(len(scores), 1)
    return scores, {
        "all_passed": round(sum(s == 1.0 for s in scores) / n, 4),
        "timeouts": status["timeout"],
        "crashed": status["crashed"] + status["output"],
        "forged": status["forged"],
        "sandbox_runs": len(runs),
    }


def http_reward(
    prompts: list[Prompt],
    responses: list[str],
    task: Any,
    url: str = "",
    batch_size: int = 32,
    retries: int = 3,
    timeout_s: float = 30.0,
    backoff_s: float = 0.5,
) -> tuple[list[float], dict[str, float]]:
    """Scores from a reward server (OpenRLHF's ``--remote_rm_url``): the rows POSTed as JSON in batches
    of ``batch_size`` -- ``{"prompts", "answers", "meta", "responses"}``, lists of equal length -- and
    ``{"scores": [...]}`` (one number per response) read back. A connection error, a timeout or a 5xx
    answer is retried ``retries`` times (waiting ``backoff_s``, doubled each time); a 4xx answer is an
    error at once. Metrics: ``requests`` and ``retried``."""
    import json
    import time
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the http reward needs url=http://HOST:PORT/PATH (got {url!r}): g.reward(..., url=...)")
    scores: list[float] = []
    requests = retried = 0
    for at in range(0, len(responses), max(1, batch_size)):
        rows = prompts[at : at + batch_size]
        body = json.dumps(
            {
                "prompts": [p.text for p in rows],
                "answers": [p.answer for p in rows],
                "meta": [p.meta for p in rows],
                "responses": responses[at : at + batch_size],
            }
        ).encode()
        for attempt in range(retries + 1):
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            requests += 1
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    got = json.loads(answer.read())
                break
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt == retries:
                    detail = exc.read(300).decode(errors="replace")
                    raise RuntimeError(f"reward server {url} answered {exc.code} {exc.reason}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == retries:
                    why = getattr(exc, "reason", exc)
                    raise RuntimeError(f"reward server {url} unreachable after {retries + 1} tries: {why}") from None
            retried += 1
            time.sleep(backoff_s * 2**attempt)
        batch = got.get("scores") if isinstance(got, dict) else None
        if not isinstance(batch, list) or len(batch) != len(rows):
            raise RuntimeError(
                f"reward server {url} answered {str(got)[:200]!r}; expected "
                f'{{"scores": [...]}} with {len(rows)} numbers'
            )
        scores += [float(x) for x in batch]
    return scores, {"requests": requests, "retried": retried}


COMPUTE_FUNCTIONS = {
    "gae": (
        gae_op,
        {
            "needs": ("rewards", "values", "responses"),
            "gives": ("advantages", "returns"),
            "optional": ("old_logprobs", "ref_logprobs"),
        },
    ),
    "grpo": (grpo_op, {"needs": ("rewards", "responses"), "gives": ("advantages",)}),
    "rloo": (rloo_op, {"needs": ("rewards", "responses"), "gives": ("advantages",)}),
    "remax": (remax_op, {"needs": ("rewards", "baseline_rewards", "responses"), "gives": ("advantages",)}),
    "reinforce_pp": (
        reinforce_pp_op,
        {"needs": ("rewards", "responses"), "gives": ("advantages",), "optional": ("old_logprobs", "ref_logprobs")},
    ),
    "overlong": (overlong_op, {"needs": ("rewards", "responses"), "gives": ("shaped",)}),
    "lagrangian": (
        lagrangian_op,
        {"needs": ("reward_advantages", "cost_advantages", "multiplier"), "gives": ("advantages",)},
    ),
    "lagrange_update": (lagrange_update_op, {"needs": ("costs", "multiplier"), "gives": ("multiplier",)}),
    "group_mean": (
        group_mean_op,
        {"needs": ("values", "prompts", "responses"), "gives": ("means",), "rows": "prompts"},  # one row per prompt
    ),
    "followup_prompts": (followup_prompts_op, {"needs": ("prompts", "responses"), "gives": ("followups",)}),
    "judge_prompts": (judge_prompts_op, {"needs": ("prompts", "responses"), "gives": ("judge_prompts",)}),
    "judge_scores": (judge_scores_op, {"needs": ("verdicts",), "gives": ("scores",)}),
    # reads any keys (its weights name them); write another key than 'rewards' with ports={"rewards": KEY}
    "weighted_sum": (weighted_sum_op, {"needs": (), "gives": ("rewards",)}),
}
FILTERS = {
    "nonconstant": (nonconstant_filter, {"needs": ("rewards", "responses")}),
    "threshold": (threshold_filter, {"needs": ("rewards",)}),
}
#: ``aggregate``: what each loss is a mean over (flowrl.specs.loss_unit)
LOSSES = {
    "ppo": (
        ppo_loss,
        {
            "needs": ("old_logprobs", "advantages"),
            "output": "logprobs",
            "optional": ("ref_logprobs",),
            "aggregate": "loss_agg",
        },
    ),
    "value": (value_loss, {"needs": ("values", "returns"), "output": "values", "aggregate": "token-mean"}),
    "gspo": (gspo_loss, {"needs": ("old_logprobs", "advantages"), "output": "logprobs", "aggregate": "seq-mean"}),
    # reads only the responses (found by their type): declared, so a train node reading more is refused
    "sft": (sft_loss, {"needs": (), "output": "logprobs", "optional": ("responses",), "aggregate": "token-mean"}),
    # preference pairs (rows 2i chosen, 2i+1 rejected), kept together by the engine: a mean over pairs
    "dpo": (
        dpo_loss,
        {"needs": ("ref_logprobs",), "output": "logprobs", "aggregate": "seq-mean", "rows": "pairs"},
    ),
    # a reward model's scores of preference pairs: pairs kept together by the engine
    "bradley_terry": (
        bradley_terry_op,
        {"needs": (), "output": "scores", "optional": ("responses",), "aggregate": "seq-mean", "rows": "pairs"},
    ),
}
REWARD_FUNCTIONS = {
    "task": task_reward,
    "verbosity": verbosity_cost,
    "code": code_reward,
    "http": http_reward,
    "episode": episode_reward,
    "agent": agent_reward,
}
