"""The speculative topology every accept length carries: a chain of k steps, or an SGLang EAGLE tree.

SGLang spells a topology with three flags (`python/sglang/srt/server_args.py`):

    --speculative-num-steps S        draft forward passes per verification (the tree's depth)
    --speculative-eagle-topk K       children kept per expanded node, and nodes expanded per step
    --speculative-num-draft-tokens T tokens verified per step: the pending token + the T - 1 best drafted
                                     nodes

How SGLang grows the tree (`eagle_utils.select_top_k_tokens`, `organize_draft_results`): the extend's last
row proposes K children of the pending token; each later step runs the draft once on the K current nodes and
scores all K x K children by cumulative log-probability, keeping the best K to expand. After S steps the
T - 1 best of all K + (S - 1) K^2 candidates are verified. With K = 1 this is a chain of S steps and SGLang
forces T = S + 1. vLLM serves EAGLE-3 as a chain: `num_speculative_tokens` k is `chain:k`.

Accept length counts the bonus token, so a topology's ceiling is S + 1 whatever K and T are.
Text form, used on the command line and in tables: "chain:3", "tree:5,8,32" (S, K, T).
"""

from __future__ import annotations

from dataclasses import dataclass

CHAIN = "chain"
TREE = "tree"


@dataclass(frozen=True)
class Topology:
    """steps S, top_k K, draft_tokens T as SGLang names them; a chain is K = 1, T = S + 1."""

    steps: int
    top_k: int = 1
    draft_tokens: int = 0  # 0: S + 1 (the only value a chain allows)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"speculative steps S must be >= 1, got {self.steps}")
        if self.top_k < 1:
            raise ValueError(f"top-k K must be >= 1, got {self.top_k}")
        if self.draft_tokens == 0:
            object.__setattr__(self, "draft_tokens", self.steps + 1 if self.top_k == 1 else 0)
        if self.top_k == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(f"with top-k 1 the tree is a chain and SGLang verifies S + 1 = {self.steps + 1} tokens, "
                             f"not {self.draft_tokens}; write chain:{self.steps}")
        if not 2 <= self.draft_tokens <= 1 + self.candidates:
            raise ValueError(f"draft tokens T = {self.draft_tokens} must be in [2, {1 + self.candidates}]: the pending token "
                             f"plus at most the K + (S - 1) K^2 = {self.candidates} nodes a tree of S={self.steps}, K={self.top_k} draws")

    # -- constructors --------------------------------------------------------------------------------
    @classmethod
    def chain(cls, steps: int) -> Topology:
        """A greedy chain of k draft steps (SGLang top-k 1, k + 1 draft tokens; vLLM num_speculative_tokens
        k)."""
        return cls(steps=steps)

    @classmethod
    def tree(cls, steps: int, top_k: int, draft_tokens: int) -> Topology:
        return cls(steps=steps, top_k=top_k, draft_tokens=draft_tokens)

    @classmethod
    def parse(cls, text: str) -> Topology:
        """"chain:3" or "tree:5,8,32" (S, K, T). A tree with K = 1 must say T = S + 1 and is a chain."""
        kind, _, rest = text.strip().partition(":")
        try:
            numbers = [int(part) for part in rest.split(",")] if rest else []
        except ValueError:
            numbers = None
        if kind == CHAIN and numbers is not None and len(numbers) == 1:
            return cls.chain(numbers[0])
        if kind == TREE and numbers is not None and len(numbers) == 3:
            return cls.tree(*numbers)
        raise ValueError(f"topology {text!r}: write chain:k (k draft steps) or tree:S,K,T "
                         "(SGLang --speculative-num-steps S --speculative-eagle-topk K --speculative-num-draft-tokens T)")

    # -- what it is ----------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return CHAIN if self.top_k == 1 else TREE

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    @property
    def candidates(self) -> int:
        """Nodes the draft scores before the T - 1 best are chosen: K + (S - 1) K^2."""
        return self.top_k + (self.steps - 1) * self.top_k ** 2

    @property
    def ceiling(self) -> int:
        """The most tokens one verification can emit: S drafted along the deepest path + the bonus token."""
        return self.steps + 1

    def __str__(self) -> str:
        if self.is_chain:
            return f"{CHAIN}:{self.steps}"
        return f"{TREE}:{self.steps},{self.top_k},{self.draft_tokens}"

    @property
    def label(self) -> str:
        """Readable, for figure legends and printed tables."""
        if self.is_chain:
            return f"chain, {self.steps} steps ({self.draft_tokens} draft tokens)"
        return f"tree S={self.steps} K={self.top_k} T={self.draft_tokens}"

    # -- records -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The four columns every tau row carries (the keys notebook 06 and `checkpoint_evaluation.summarize`
        use)."""
        return {"topology": self.kind, "steps": self.steps, "top_k": self.top_k, "draft_tokens": self.draft_tokens}

    @classmethod
    def from_dict(cls, record: dict) -> Topology:
        missing = [key for key in ("topology", "steps") if key not in record]
        if missing:
            raise ValueError(f"topology record {record!r} lacks {missing}; expected keys topology, steps, top_k, draft_tokens")
        topology = cls(steps=int(record["steps"]), top_k=int(record.get("top_k", 1)), draft_tokens=int(record.get("draft_tokens", 0)))
        if record["topology"] != topology.kind:
            raise ValueError(f"topology record {record!r} says {record['topology']!r} but top_k {topology.top_k} makes it "
                             f"a {topology.kind}")
        return topology

    # -- serving settings ----------------------------------------------------------------------------
    def sglang_flags(self) -> list[str]:
        """SGLang server arguments for this topology (an EAGLE-3 draft needs the EAGLE3 algorithm, DESIGN)."""
        return ["--speculative-algorithm", "EAGLE3",
                "--speculative-num-steps", str(self.steps),
                "--speculative-eagle-topk", str(self.top_k),
                "--speculative-num-draft-tokens", str(self.draft_tokens)]

    @property
    def sglang_command_line(self) -> str:
        return " ".join(self.sglang_flags())

    def vllm_speculative_config(self, draft_dir: str) -> dict | None:
        """vLLM's `--speculative-config` for a chain; None for a tree (vLLM's EAGLE-3 proposer drafts
        chains)."""
        if not self.is_chain:
            return None
        return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": self.steps}


def parse_topologies(texts: list[str] | tuple[str, ...]) -> list[Topology]:
    """Several topologies, duplicates dropped in order; an empty list is an error."""
    topologies = list(dict.fromkeys(Topology.parse(text) for text in texts))
    if not topologies:
        raise ValueError("no topology given: pass e.g. chain:3 or tree:5,8,32")
    return topologies
