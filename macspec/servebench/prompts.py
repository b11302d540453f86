"""The built-in prompt set (chat and code), or the user's own from --prompts FILE."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MacspecError

CHAT = [
    "Explain in three sentences why speculative decoding does not change a model's output.",
    "Write a short email asking a colleague to review a pull request before Friday.",
    "What are the trade-offs between tensor parallelism and pipeline parallelism?",
    "Summarise the plot of a heist film in one paragraph, without naming it.",
]
CODE = [
    "def fibonacci(n):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and validate it.\"\"\"",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]
BUILTIN = CODE + CHAT


def load_prompts(path: str | None) -> list[str]:
    """FILE: a JSON list of strings, JSON lines with a "prompt" field, or one prompt per line."""
    if path is None:
        return list(BUILTIN)
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as err:
        raise MacspecError(f"--prompts {path}: {err.strerror}") from None
    stripped = text.strip()
    if stripped.startswith("["):
        prompts = json.loads(stripped)
    elif stripped.startswith("{"):
        prompts = [json.loads(line)["prompt"] for line in stripped.splitlines() if line.strip()]
    else:
        prompts = [line for line in stripped.splitlines() if line.strip()]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise MacspecError(f"--prompts {path}: expected non-empty prompts (a JSON list of strings, "
                           "JSON lines with \"prompt\", or one per line)")
    return prompts
