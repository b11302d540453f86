"""A radix tree over token sequences (SGLang's RadixAttention shape): the longest shared prefix
of a prompt with any stored sequence in time linear in the prompt, not in the number of entries.

Edges hold runs of tokens; a node marks where a stored sequence ends. Every leaf holds an entry
(empty leaves are pruned), so below any node an entry is reached by following any child.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    edge: tuple[int, ...] = ()
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    key: tuple[int, ...] | None = None  # the stored sequence ending here, if any


def _shared(edge: tuple[int, ...], tokens, start: int) -> int:
    """How many of `edge`'s tokens `tokens[start:]` begins with."""
    run = tuple(tokens[start:start + len(edge)])
    if run == edge:
        return len(edge)
    n = 0
    for a, b in zip(edge, run):
        if a != b:
            break
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = Node()
        self.nodes: dict[tuple[int, ...], Node] = {}  # stored key -> the node it ends at

    def longest_match(self, tokens) -> tuple[int, tuple[int, ...] | None]:
        """(length of the longest prefix `tokens` shares with a stored key, one such key)."""
        node, depth = self._descend(tokens)
        if node is self.root:
            return 0, None
        return depth, self._any_key_below(node)

    def _descend(self, tokens) -> tuple[Node, int]:
        """The deepest node `tokens` reach (its edge maybe matched only in part), and the depth."""
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = _shared(child.edge, tokens, depth)
            depth += n
            node = child
            if n < len(child.edge):
                break
        return node, depth

    def candidates(self, tokens):
        """(stored key, tokens it shares with `tokens`) for every key sharing a prefix with them,
        sharing no more than the one before: the keys below the deepest match (all share its
        depth), then its ancestors' (each shares its own length)."""
        node, depth = self._descend(tokens)
        if node is self.root:
            return
        stack = [node]
        while stack:
            below = stack.pop()
            if below.key is not None:
                yield below.key, depth
            stack.extend(below.children.values())
        above = node.parent
        while above is not None and above is not self.root:
            if above.key is not None:
                yield above.key, len(above.key)
            above = above.parent

    def insert(self, key: tuple[int, ...]) -> None:
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                leaf = Node(key[depth:], node)
                node.children[key[depth]] = leaf
                node = leaf
                break
            n = _shared(child.edge, key, depth)
            if n < len(child.edge):
                child = self._split(child, n)
            depth += n
            node = child
        node.key = key
        self.nodes[key] = node

    def remove(self, key: tuple[int, ...]) -> None:
        node = self.nodes.pop(key)
        node.key = None
        while node is not self.root and node.key is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent

    def keys_on_path(self, key: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Stored keys that are prefixes of `key` (itself included, if stored)."""
        out, node, depth = [], self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None or _shared(child.edge, key, depth) < len(child.edge):
                break
            depth += len(child.edge)
            node = child
            if node.key is not None:
                out.append(node.key)
        return out

    @staticmethod
    def _split(child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens -> the new middle node."""
        middle = Node(child.edge[:n], child.parent)
        middle.parent.children[child.edge[0]] = middle
        child.edge = child.edge[n:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    @staticmethod
    def _any_key_below(node: Node) -> tuple[int, ...]:
        while node.key is None:
            node = next(iter(node.children.values()))
        return node.key
