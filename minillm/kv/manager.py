"""The KV-cache manager: the one place that changes the block pool, in terms of requests.

The pool (`paged.py`, `prefix_cache.py`) knows sequences, blocks and reference counts. The engine thinks
in requests. Between them sits this manager, and nothing else in the engine touches the pool:

    computed_blocks(req)        the cached blocks holding the longest prefix of req's tokens
    blocks_to_admit(req, ...)   free blocks that admitting req would take
    admit(req, cached)          req starts, holding its cached prefix
    can_append / append(req, n) room for n more tokens' K/V (a shared partial block is copied first)
    cache_full_blocks(req)      blocks now full of computed K/V become findable by content
    fork(parent, child)         child shares every block of parent (n > 1 samples of one prompt)
    truncate(req, n)            keep n tokens: rejected drafts' K/V are forgotten
    free(req)                   give back req's blocks (cached ones stay findable)

K/V that arrive from elsewhere (another worker, another rank) go through it too:

    reserve(seq, n)             seq holds room for n tokens, to be filled by a transfer
    borrow_prefix(seq, tokens)  seq holds the cached blocks of tokens' prefix while they are sent
    register_prefix(seq, tokens)  seq's full blocks become findable as tokens' prefix
    copy_blocks(copies)         make another pool's copy-on-write copies here too (tensor parallelism)

A request carries what the manager needs to know about it: its tokens, `num_computed_tokens` (how many
of them have K/V), and the content addresses of its full blocks so far (`block_hashes`, the first
`num_hashed_blocks` of them registered in the cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .paged import BlockPool
from .prefix_cache import PrefixCachingPool, chain_hashes


@dataclass
class Sequence:
    """What the manager needs of a sequence that is not an engine request (the paged stage's)."""
    request_id: int
    block_hashes: list = field(default_factory=list)
    num_hashed_blocks: int = 0


class KVCacheManager:
    def __init__(self, pool: BlockPool, log_copies: bool = False):
        """log_copies: the pool keeps a list of the copy-on-write copies it makes (`pool.copy_log`), for
        other pools that must make them too (the ranks of a tensor-parallel engine)."""
        self.pool = pool
        self.prefix_caching = isinstance(pool, PrefixCachingPool)
        self.block_size = pool.block_size
        if log_copies:
            pool.copy_log = []
        self.prefix_cache_queries = self.prefix_cache_hits = 0     # tokens looked up / found at admission

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_slots(self, req) -> int:
        """Tokens req has room for (computed, and reserved for this step)."""
        return self.pool.lengths[req.request_id]

    def block_table(self, req) -> list[int]:
        return self.pool.tables[req.request_id]

    def computed_blocks(self, req) -> list[int]:
        """Blocks of the cache holding the longest prefix of req's tokens, at most all but the block
        of its last token (that one is computed: its logits are needed, and cached blocks are never written)."""
        if not self.prefix_caching or req.prompt_logprobs is not None:   # (scoring: every token's logits)
            return []
        bs, tokens = self.block_size, req.all_token_ids
        usable = (len(tokens) - 1) // bs
        req.block_hashes = chain_hashes(tokens[:usable * bs], bs, req.cache_salt, req.block_hashes)
        return self.pool.lookup(req.block_hashes[:usable], tokens)

    def blocks_to_admit(self, req, cached: list[int], n: int) -> int:
        """Free blocks that admitting req with `cached` and computing n more tokens takes."""
        held = len(cached) * self.block_size
        new = self.pool.blocks_for(held + n) - len(cached)
        return new + (self.pool.blocks_to_reuse(cached) if cached else 0)

    def can_append(self, req, n: int) -> bool:
        return self.pool.can_append(req.request_id, n)

    # ------------------------------------------------------------ changes
    def admit(self, req, cached: list[int]) -> int:
        """req starts holding `cached` (from computed_blocks); returns the tokens they hold."""
        self.pool.allocate(req.request_id, 0)
        if cached:
            self.pool.share(req.request_id, cached)
        req.num_hashed_blocks = len(cached)
        tokens = len(cached) * self.block_size
        if self.prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += tokens
        return tokens

    def append(self, req, n: int) -> None:
        """Room for n more tokens' K/V (OutOfBlocks, changing nothing, if the pool lacks it)."""
        self.pool.grow(req.request_id, n)

    def cache_full_blocks(self, req) -> None:
        """Blocks now full of computed K/V become findable by content (prompt and answer alike, so a
        chat's next turn finds its history). Tokens after an accepted end token are not kept."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens, req.num_tokens) // bs
        if full <= req.num_hashed_blocks:
            return
        tokens = req.token_slice(0, full * bs)
        req.block_hashes = chain_hashes(tokens, bs, req.cache_salt, req.block_hashes)
        table = self.pool.tables[req.request_id]
        for j in range(req.num_hashed_blocks, full):
            self.pool.register(table[j], req.block_hashes[j], tokens[j * bs:(j + 1) * bs])
        req.num_hashed_blocks = full

    def fork(self, parent, child) -> None:
        """child shares every block of parent: no copy, the blocks' reference counts go up."""
        self.pool.fork(parent.request_id, child.request_id)
        child.block_hashes, child.num_hashed_blocks = list(parent.block_hashes), parent.num_hashed_blocks

    def truncate(self, req, length: int) -> None:
        """Keep the K/V of req's first `length` tokens; whole blocks past them go back."""
        if self.pool.lengths[req.request_id] > length:
            self.pool.truncate(req.request_id, length)

    def free(self, req) -> None:
        """Give back req's blocks (shared ones stay until their last user lets go; cached ones stay findable)."""
        self.pool.free_seq(req.request_id)

    # ------------------------------------------------------------ K/V from elsewhere
    def reserve(self, seq, n: int) -> None:
        """seq starts holding room for n tokens (OutOfBlocks, changing nothing, if the pool lacks it)."""
        self.pool.allocate(seq.request_id, n)

    def _prefix_addresses(self, tokens: list[int]) -> list[bytes]:
        """Addresses of the blocks of tokens that a request can take from the cache (all but the last token's)."""
        bs = self.block_size
        return chain_hashes(tokens[:(len(tokens) - 1) // bs * bs], bs)

    def borrow_prefix(self, seq, tokens: list[int]) -> list[int]:
        """seq holds the cached blocks of tokens' longest cached prefix (free it when done); their ids."""
        blocks = self.pool.lookup(self._prefix_addresses(tokens), tokens)
        self.pool.allocate(seq.request_id, 0)
        self.pool.share(seq.request_id, blocks)
        return blocks

    def register_prefix(self, seq, tokens: list[int]) -> None:
        """seq's blocks, filled with the K/V of tokens' prefix, become findable by content."""
        bs, table = self.block_size, self.pool.tables[seq.request_id]
        for j, address in enumerate(self._prefix_addresses(tokens)):
            self.pool.register(table[j], address, tokens[j * bs:(j + 1) * bs])

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Make copy-on-write copies another pool made: the first `tokens` slots of block a into b."""
        pool = self.pool
        for a, b, tokens in copies:
            pool.k[:, b, :tokens] = pool.k[:, a, :tokens]
            pool.v[:, b, :tokens] = pool.v[:, a, :tokens]
