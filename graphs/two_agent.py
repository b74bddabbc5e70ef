"""Two policies trained together from one reward: a proposer writes a hint, a solver answers with it.

The proposer reads the prompt and writes a hint (2 per prompt). Each hint, appended to its
prompt, becomes a question the solver answers (4 answers per question). The solver is rewarded
for its answers; the proposer for the mean reward its hint earned the solver. Each policy has its
own generate, forward and train nodes and its own optimizer; one GRPO compute function serves both,
bound by ports to each one's rewards and responses.
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"rollout": {"prompts_per_step": 16, "samples_per_prompt": 4}, "steps": 300}


def build(cfg: RunConfig) -> Graph:
    g = Graph("two_agent")
    g.model("proposer", "actor")
    g.model("solver", "actor")

    # The proposer hints; each hint makes one question for the solver.
    g.generate("propose", model="proposer", reads="prompts", writes="hints", n=2)
    g.compute(
        "questions",
        fn="followup_prompts",
        reads="prompts hints",
        writes="questions",
        ports={"responses": "hints", "followups": "questions"},
        sep=">",
    )
    g.generate("solve", model="solver", reads="questions", writes="answers", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="questions answers", writes="solver_rewards")

    # The shared reward: each hint earns the mean reward of the answers to its question.
    g.compute(
        "hint_rewards",
        fn="group_mean",
        reads="solver_rewards questions answers",
        writes="proposer_rewards",
        ports={"values": "solver_rewards", "prompts": "questions", "responses": "answers", "means": "proposer_rewards"},
    )

    # One compute function, bound to each policy's rewards and responses.
    g.compute(
        "solver_advantages",
        fn="grpo",
        reads="solver_rewards answers",
        writes="solver_advantages",
        ports={"rewards": "solver_rewards", "responses": "answers", "advantages": "solver_advantages"},
    )
    g.compute(
        "proposer_advantages",
        fn="grpo",
        reads="proposer_rewards hints",
        writes="proposer_advantages",
        ports={"rewards": "proposer_rewards", "responses": "hints", "advantages": "proposer_advantages"},
    )
    g.forward("solver_logprobs", model="solver", output="logprobs", reads="answers", writes="solver_old_logprobs")
    g.forward("proposer_logprobs", model="proposer", output="logprobs", reads="hints", writes="proposer_old_logprobs")
    g.train(
        "train_solver",
        model="solver",
        loss="ppo",
        reads="answers solver_old_logprobs solver_advantages",
        ports={"old_logprobs": "solver_old_logprobs", "advantages": "solver_advantages"},
    )
    g.train(
        "train_proposer",
        model="proposer",
        loss="ppo",
        reads="hints proposer_old_logprobs proposer_advantages",
        ports={"old_logprobs": "proposer_old_logprobs", "advantages": "proposer_advantages"},
    )
    return g
