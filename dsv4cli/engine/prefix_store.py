"""The prefix store: snapshots of decode state at every 128th position of the prompts the engine prefilled,
so a prompt that starts as an earlier one did copies that prefix's state into its slot and prefills only
the rest.

Boundaries. A snapshot is taken where a prefill chunk ends at P = 128k (the scheduler ends chunks there:
`prefill_chunks`; a chunk running past P would overwrite window rows from before P). There every
compressor has just closed a block of both ratios: the HCA compressor carries no rows into the next block
and the CSA one the overlapping half of its last (4 rows), so the snapshot is the blocks and indexer keys
closed before P and each ring's rows a call at P reads: the window's last window-1, those 4 compressor
rows, the drafter's window (`LayerCache.carried`).

Keys. Boundary P of a prompt is keyed by a hash chain over its 128-token blocks, seeded with the state's
identity (model, dtype, drafter: `snapshot.state_identity`), and by the token at P, which the MTP layer's
row P-1 read.

Nodes. The snapshot at P is a node whose parent is the longest stored prefix of the same prompt. It holds
the blocks closed between its parent's end and P (a shared prefix's blocks are stored once) and its own
rows. The rows are most of a node's bytes and only a resume at exactly P reads them, while every longer
prefix reads the blocks: eviction drops rows, least recently resumed first, and a node left with neither
rows nor children goes with them.

Tiers. A node starts in device memory (`device_bytes`). When that is full the least recently used node moves
to host memory (`host_bytes`; on the CPU both are host memory and the default keeps no second tier); a
resume copies from either tier into the slot and brings the nodes it read back to the device. Neither tier
ever holds more than its budget.
"""
import hashlib
from array import array
from dataclasses import dataclass

import torch

from dsv4cli.model import DecodeState

from .snapshot import nbytes, put_blocks, put_rows, take_blocks, take_rows

BOUNDARY = 128      # the largest compress ratio: every compressor closes a block here (a multiple of the others)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(eq=False)
class Node:
    """The snapshot at `end`: blocks closed since the parent's end, and the rows a resume at `end` reads (None
    once evicted: the node then only carries blocks for longer prefixes)."""
    key: bytes
    parent: "Node | None"
    end: int
    blocks: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor] | None
    used: int = 0           # the clock when a resume last read it, or when it was stored
    resumed: int = 0        # the clock when a resume last started at its end
    children: int = 0
    on_host: bool = False

    @property
    def start(self) -> int:
        return self.parent.end if self.parent is not None else 0

    def nbytes(self) -> int:
        return nbytes(self.blocks) + (nbytes(self.rows) if self.rows is not None else 0)

    def chain(self) -> list["Node"]:
        """This node and its ancestors, the root first."""
        node, chain = self, []
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]


class PrefixStore:
    """Snapshots of the slots of `state` at prompt boundaries, within `device_bytes` of device memory and
    `host_bytes` of host memory. `salt`: the state's identity, seeding every key."""

    def __init__(self, state: DecodeState, device_bytes: int, host_bytes: int = 0, salt: bytes = b""):
        self.state, self.salt = state, salt
        self.device = state.layers[0].win.device
        self.budget = {False: device_bytes, True: host_bytes}    # by tier: on host or not
        self.held = {False: 0, True: 0}                          # bytes held, by tier
        self.nodes: dict[bytes, Node] = {}
        self.clock = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The key of each boundary P = 128, 256, ... below len(tokens): its blocks' hash chain and token P."""
        keys, chain = [], _digest(self.salt)
        for p in range(BOUNDARY, len(tokens), BOUNDARY):
            chain = _digest(chain + array("q", tokens[p - BOUNDARY: p]).tobytes())
            keys.append(_digest(chain + array("q", tokens[p: p + 1]).tobytes()))
        return keys

    def longest(self, keys: list[bytes]) -> Node | None:
        """The longest stored prefix of the prompt with these keys that a resume can start at."""
        return next((n for k in reversed(keys) if (n := self.nodes.get(k)) is not None and n.rows is not None), None)

    def restore(self, node: Node, slot: int) -> int:
        """Put the snapshot `node` into slot `slot`; returns its end, where the prompt's prefill resumes."""
        self.clock += 1
        for n in node.chain():
            put_blocks(self.state, slot, n.start, n.blocks)
            n.used = self.clock
        put_rows(self.state, slot, node.end, node.rows)
        node.resumed = self.clock
        for n in node.chain():
            if n.on_host:
                self._move(n, to_host=False)
        self._fit()
        return node.end

    def store(self, keys: list[bytes], slot: int, pos: int) -> None:
        """Snapshot slot `slot` at boundary `pos` of the prompt with these keys, whose chunk just ended there."""
        self.clock += 1
        k = pos // BOUNDARY - 1
        node = self.nodes.get(keys[k])
        if node is None:
            parent = next((self.nodes[key] for key in reversed(keys[:k]) if key in self.nodes), None)
            node = Node(keys[k], parent, pos, take_blocks(self.state, slot, parent.end if parent else 0, pos), None)
            if parent is not None:
                parent.children += 1
            self.nodes[node.key] = node
            self.held[False] += node.nbytes()
        if node.rows is None:       # rows evicted earlier: the node takes this slot's again
            if node.on_host:
                self._move(node, to_host=False)
            node.rows = take_rows(self.state, slot, pos)
            self.held[False] += nbytes(node.rows)
        node.used = node.resumed = self.clock
        self._fit()

    # ---- the budgets ----------------------------------------------------------------------------------

    def _fit(self) -> None:
        """Spill and evict, least recently used first, until each tier is within its budget."""
        while self.held[False] > self.budget[False]:
            device = [n for n in self.nodes.values() if not n.on_host]
            spill = min(device, key=lambda n: n.used)
            if spill.nbytes() <= self.budget[True]:
                self._move(spill, to_host=True)
            else:
                self._evict(device)
        while self.held[True] > self.budget[True]:
            self._evict([n for n in self.nodes.values() if n.on_host])

    def _evict(self, tier: list[Node]) -> None:
        """Drop the least recently resumed rows of this tier (of any tier where it has none), and every node
        that leaves with neither rows nor children."""
        node = min((n for n in tier if n.rows is not None), default=None, key=lambda n: n.resumed) or \
            min((n for n in self.nodes.values() if n.rows is not None), key=lambda n: n.resumed)
        self.held[node.on_host] -= nbytes(node.rows)
        node.rows = None
        while node is not None and node.rows is None and not node.children:
            del self.nodes[node.key]
            self.held[node.on_host] -= nbytes(node.blocks)
            node = node.parent
            if node is not None:
                node.children -= 1

    def _move(self, node: Node, to_host: bool) -> None:
        """A node's tensors into the other tier (a copy, so the first tier's memory is freed)."""
        size = node.nbytes()
        for parts in (node.blocks, node.rows or {}):
            for name, t in parts.items():
                parts[name] = t.to("cpu", copy=True) if to_host else t.to(self.device)
        self.held[node.on_host] -= size
        self.held[to_host] += size
        node.on_host = to_host
