"""A judged environment: no verifier, the project's LLM judge scores each episode by a rubric.

    environments:
      judged:
        module: examples.judged.judged_env
        tasks: examples/judged/tasks.jsonl
    judge: {model: my-judge, rubric: examples/judged/rubric.md}
    runtime:
      judge: {url: "http://127.0.0.1:8000/v1"}     # or server_command: ... --port {port}

The tasks are messages only (`{task_id, messages}`): what a verifier would need is what this
environment does without. README.md here says how to run a cycle with it.
"""

from stages.envs import judge

TOOLS = []  # no tools: the judge reads the conversation
VERSION = "judged@1"


def reward(task, messages):
    """The judge's pointwise score of the episode (`{"judge": s}`, its reasoning kept)."""
    return judge.score(task, messages)


def reward_group(task, episodes):
    """Every sample of a task judged together, each against the others (suits GRPO)."""
    return judge.rank(task, episodes)
