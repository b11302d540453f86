"""Chat prompts from text every machine has, for distilling a head on a chat model's own answers.

Sources: the standard library's docstrings (corpus.stdlib_files), pydoc's topic pages, man-page
NAME lines where /usr/share/man exists, and a built-in list of general topics, so the prompts
reach beyond Python. Which prompts are held out depends on the prompt text only. Reference pairs
(a question and a human-written answer: a docstring, a pydoc topic) add teacher-forced text,
as EAGLE trains on fixed responses: the target's distributions over them cost one forward.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import zlib
from pathlib import Path

from .. import corpus

HELDOUT_MODULUS = 10  # 1 prompt in 10 is held out for evaluation
MAN_DIR = Path("/usr/share/man/man1")

GENERAL_TOPICS = (
    "RDMA", "TCP congestion control", "a hash table", "photosynthesis", "the Fourier transform",
    "a compiler", "garbage collection", "public-key cryptography", "DNS", "a neural network",
    "gradient descent", "virtual memory", "a mutex", "the CAP theorem", "HTTP/2", "a B-tree",
    "inflation", "the water cycle", "plate tectonics", "a black hole", "vaccines", "DNA",
    "the French Revolution", "supply and demand", "a GPU", "cache coherence", "Kubernetes",
    "a load balancer", "SQL joins", "unit testing", "version control", "recursion",
    "the speed of light", "climate change", "a transistor", "quantum entanglement",
    "the stock market", "machine learning", "an operating system kernel", "Bluetooth",
    "speculative decoding", "a linked list", "Docker containers", "the immune system",
    "renewable energy", "a REST API", "binary search", "the Pythagorean theorem", "entropy",
    "a blockchain", "memory bandwidth", "floating-point numbers", "Unicode", "a file system",
    "an index in a database", "the Internet", "electric cars", "the Roman Empire", "tides",
    "a rainbow", "sleep", "coffee", "volcanoes", "the Moon landing", "jazz", "chess openings",
)
GENERAL_FORMS = (
    "Explain what {} is in two sentences.", "What is {}?", "Give three facts about {}.",
    "Explain {} to a ten-year-old.", "Why does {} matter?", "Write a short paragraph about {}.",
)


def _first_paragraph(doc: str, limit: int = 600) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())[:limit]


def _docstrings(path: Path):
    """(module name, module doc, [(function name, its doc)]) of one stdlib file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    funcs = [(node.name, ast.get_docstring(node)) for node in tree.body
             if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    module = path.parent.name if path.stem == "__init__" else path.stem
    return module, ast.get_docstring(tree), [(n, d) for n, d in funcs if d]


def stdlib_prompts(rng: random.Random) -> list[str]:
    out = []
    for path in corpus.stdlib_files():
        found = _docstrings(path)
        if not found:
            continue
        module, doc, funcs = found
        if doc and len(_first_paragraph(doc)) > 120:
            out.append(f"Summarize: {_first_paragraph(doc)}")
        for name, fdoc in rng.sample(funcs, min(2, len(funcs))):
            line = _first_paragraph(fdoc, 200)
            if rng.random() < 0.5:
                out.append(f"Explain what the Python function {module}.{name}() does.")
            elif len(line) > 20:
                out.append(f"Write a Python function that does this: {line}")
    return out


def pydoc_prompts() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for name, text in sorted(topics.items()):
        para = next((p for p in text.split("\n\n")[1:] if len(p) > 150), None)
        out.append(f"Explain the Python concept '{name}' with an example.")
        if para:
            out.append(f"Summarize: {' '.join(para.split())[:600]}")
    return out


def man_prompts(limit: int = 150) -> list[str]:
    """'Explain what the `ls` command does.' from NAME lines; none where man pages are absent."""
    out = []
    for path in sorted(MAN_DIR.glob("*.1.gz"))[:2000] if MAN_DIR.is_dir() else []:
        try:
            with gzip.open(path, "rt", errors="replace") as f:
                head = f.read(4000)
        except OSError:
            continue
        match = re.search(r"\.SH NAME\s*\n(.+?)\s+\\-\s+(.+)", head)
        if match and len(match.group(2)) > 10:
            name = re.sub(r"^\.\w+\s+", "", match.group(1)).replace("\\", "").split(",")[0].strip()
            out.append(f"Explain what the `{name}` command does ({match.group(2).strip()}).")
    return out[::max(1, len(out) // limit)][:limit]


def general_prompts() -> list[str]:
    return [form.format(topic) for i, topic in enumerate(GENERAL_TOPICS)
            for form in (GENERAL_FORMS[i % len(GENERAL_FORMS)], GENERAL_FORMS[(i + 3) % len(GENERAL_FORMS)])]


def is_heldout(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELDOUT_MODULUS == 0


def build_prompts(count: int, seed: int = 0) -> list[str]:
    """About `count` prompts, a deterministic mix of every source (man pages where present)."""
    rng = random.Random(seed)
    pools = [stdlib_prompts(rng), pydoc_prompts(), man_prompts(), general_prompts()]
    shares = [0.4, 0.2, 0.15, 0.25]
    chosen: list[str] = []
    for pool, share in zip(pools, shares):
        pool = sorted(set(pool))
        chosen += rng.sample(pool, min(len(pool), round(count * share)))
    rng.shuffle(chosen)
    return chosen


def split(prompts: list[str]) -> tuple[list[str], list[str]]:
    """-> (train, held out)."""
    return [p for p in prompts if not is_heldout(p)], [p for p in prompts if is_heldout(p)]


def reference_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs: functions' and modules' docstrings, pydoc topics in pieces;
    a question that is a held-out prompt is left out."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    pairs = []
    for path in corpus.stdlib_files():
        found = _docstrings(path)
        if not found:
            continue
        module, doc, funcs = found
        if doc and len(doc) > 300:
            pairs.append((f"What does the Python module {module} do?", doc.strip()))
        pairs += [(f"Explain what the Python function {module}.{name}() does.", d.strip())
                  for name, d in funcs if len(d) > 200]
    for name, text in sorted(topics.items()):
        parts = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
        pairs += [(f"Explain the Python concept '{name}' with an example.", "\n\n".join(parts[i:i + 3]))
                  for i in range(0, len(parts), 3)]
    pairs = [p for p in pairs if not is_heldout(p[0])]
    return rng.sample(pairs, min(count, len(pairs)))
