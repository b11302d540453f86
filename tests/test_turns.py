"""TurnMemory: a remembered answer inside a rendered prompt is encoded as its generated ids."""

from __future__ import annotations

from macspec.server.turns import TurnMemory


class CharTokenizer:
    """One token per character, except that "\\n\\n" is one token (as BPE merges it)."""

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text.startswith("\n\n", i):
                out.append(1000)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out


def test_answers_are_spliced_as_generated_and_others_encoded_canonically():
    memory = TurnMemory(CharTokenizer())
    generated = [ord("#"), 10, 10, 10]  # "#\n\n\n" as the model produced it
    memory.remember("#\n\n\n", generated)
    prompt = "user: hi\n\nassistant: #\n\n\nuser: again"
    ids = memory.encode(prompt)
    assert ids == (CharTokenizer().encode("user: hi\n\nassistant: ") + generated
                   + CharTokenizer().encode("user: again"))
    assert TurnMemory(CharTokenizer()).encode(prompt) == CharTokenizer().encode(prompt)


def test_memory_is_bounded_and_skips_tiny_answers():
    memory = TurnMemory(CharTokenizer(), max_turns=2)
    memory.remember("ok", [1, 2])
    for text in ("first answer", "second answer", "third answer"):
        memory.remember(text, [7])
    assert list(memory.answers) == ["second answer", "third answer"]
