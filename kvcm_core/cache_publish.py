"""Publishing a :class:`~kvcm_core.cache.KVCache`'s blocks into the prefix tree: full
blocks at commit (a whole range at once), the trailing partial block and the SSM state at
close, SSM snapshots at commit (``commit_min_snapshot``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcm_core.backend import Stream
from kvcm_core.cache_base import CacheBase
from kvcm_core.errors import OutOfPagesError
from kvcm_core.radix import NO_NODE, extend_keys, key_cursor

__all__ = ["LEAF_BLOCK_PRIORITY", "PARTIAL_BLOCK_PRIORITY", "PublishMixin"]

#: Eviction priority of a trailing partial block published at close (when the engine gave
#: no priority callback): the lowest, so it only keeps otherwise free room. Only a prompt
#: that repeats it or extends it inside the same block can reuse it, and it costs a whole
#: page; vLLM does not keep it at all.
PARTIAL_BLOCK_PRIORITY = 0
#: Eviction priority, from its close on, of a cache's leaf block (when the engine gave no
#: priority callback): the deepest full block it published itself that no other request
#: has used. Of a chain, the leaf is the block least likely to be shared (a prompt that
#: shares it shares every block before it), so it goes first, as vLLM frees a request's
#: blocks tail first; a later request that extends exactly this one recomputes at most
#: this block.
LEAF_BLOCK_PRIORITY = 1


class PublishMixin(CacheBase):
    """Commit-time and close-time publishing."""

    def _parent_node(self, block: int) -> int:
        """The node a new block goes under, or ``NO_NODE`` if that chain left the tree."""
        tree = self._tree
        if block == 0:
            return tree.root(self._root_key)
        nid = self._nodes[block - 1]
        # Node ids are recycled: the node is ours only while its key still names it.
        return nid if tree.index.get(self._keys[block - 1]) == nid else NO_NODE

    def _block_key(self, block: int) -> bytes:
        keys = self._keys
        if len(keys) <= block:
            # Key every missing block up to ``block``, continuing from the cursor: the
            # match's, or, after a match cut short or a rewind, one rebuilt from the known
            # tokens (in one C call).
            b0 = len(keys)
            tpb = self._tpb
            cursor = self._cursor
            if cursor is None:
                cursor = key_cursor(self._root_key, self._tokens.items(0, b0 * tpb), tpb, b0,
                                    keys[-1] if b0 else None)
            self._cursor = extend_keys(keys, self._root_key,
                                       self._tokens.items(b0 * tpb, (block + 1) * tpb), tpb,
                                       b0, cursor)
        return keys[block]

    def _publish_range(self, b0: int, b1: int, stream: Stream | None = None) -> None:
        """Publish full blocks ``[b0, b1)`` (the hot path of prefill commits); ``stream``
        (the commit's) waits for copies still bringing in a tree page a block rebases
        onto."""
        tree = self._tree
        L = self._levels
        a = self._arena
        tpb = self._tpb
        groups = self._ctx.publish_groups
        self._block_key(b1 - 1)
        keys = self._keys
        parent = self._parent_node(b0)
        if parent == NO_NODE:
            if groups or not self._ctx.ssm_groups:
                self._commit_on = False
                return
            # A model that publishes only SSM states keys its blocks into nodes with no
            # page, which a cache with the same tokens may have collected: key the chain
            # again from the root (nothing was in it).
            del self._nodes[:]
            b0 = self._published = 0
        # Blocks already in the tree form a prefix of the range (a node exists only under
        # its parent): publish into them or rebase onto them one by one.
        get = tree.index.get
        b = b0
        while b < b1:
            nid = get(keys[b])
            if nid is None:
                break
            self._publish_existing(b, nid, groups, stream)
            self._nodes.append(nid)
            self._published = b + 1
            b += 1
        if b == b1:
            return
        parent = self._nodes[b - 1] if b else tree.root(self._root_key)
        rows, mm = self._tokens.rows(b * tpb, b1 * tpb, tpb)
        # (A block holding a digest covers no partial block: those hold plain tokens only,
        # and its int32 row gives each digest's first 4 bytes, which a token may equal.)
        if tree.has_partial_children(parent) and not (
                mm and any(type(t) is bytes for t in self._tokens.items(b * tpb,
                                                                      (b + 1) * tpb))):
            self._supersede_partials(parent, tuple(rows[0].tolist()))
        if b1 - b == 1 and not mm:  # the decode step: one block, scalar bookkeeping
            nid = tree.add_one(parent, keys[b], rows[0], b)
            for g in groups:
                pages_g = self._pages[g]
                mine = pages_g[b] if b < len(pages_g) else -1
                if mine >= 0 and a.node[mine] < 0:
                    L.publish_one(mine, nid, g)
            self._nodes.append(nid)
            self._published = b1
            return
        items = None
        if mm:
            flat = list(self._tokens.items(b * tpb, b1 * tpb))
            items = [flat[i : i + tpb] for i in range(0, len(flat), tpb)]
        nids = tree.add_chain(parent, keys[b:b1], rows, b, mm, items)
        for g in groups:
            ours = np.asarray(self._pages[g][b:b1], dtype=np.int64)
            if len(ours) < len(nids):
                ours = np.concatenate([ours, np.full(len(nids) - len(ours), -1, np.int64)])
            ok = ours >= 0
            if np.count_nonzero(ok) == len(ok):
                ok = a.node[ours] < 0
            else:
                ok[ok] = a.node[ours[ok]] < 0
            if np.count_nonzero(ok):
                L.publish(ours[ok], nids[ok], g)
        self._nodes.extend(nids.tolist())
        self._published = b1

    def _publish_existing(self, b: int, nid: int, groups: Any,
                          stream: Stream | None = None) -> None:
        tree = self._tree
        L = self._levels
        a = self._arena
        for g in groups:
            pages_g = self._pages[g]
            mine = pages_g[b] if b < len(pages_g) else -1
            if mine < 0:
                continue
            theirs = int(tree.pages[nid, g])
            if theirs == mine:
                continue
            if theirs < 0:
                L.publish(np.asarray([mine]), np.asarray([nid]), g)
            elif a.level[theirs] == 0 and a.node[mine] < 0:
                # Rebase onto the identical tree block and free our copy. Kernels fenced
                # by a Batch's record_read may still read ours: waited for first, so an
                # interrupt there changes nothing. The engine's next kernels read theirs
                # on ``stream``: after a copy still bringing it in.
                self._wait_readers()
                L.wait_pages(stream, np.asarray([theirs]))
                L.claim(np.asarray([theirs]), 1, 0)  # shared now: see _demote_leaf
                a.reused[theirs] = True
                pages_g[b] = theirs
                L.change(np.asarray([mine]), -1, 0)
                L.stats.groups[g].rebased_blocks += 1
                self._changed()

    def _supersede_partials(self, parent: int, tokens: tuple[int, ...]) -> None:
        """Remove partial children that ``tokens`` covers (the longer block wins)."""
        tree = self._tree
        for p in tree.partial_children(parent, tokens[0]):
            ptoks = tree.block_tokens(p)
            if tokens[: len(ptoks)] == ptoks and len(ptoks) < len(tokens):
                self._levels.unpublish_node(p)

    def _snapshot(self, nid: int, stream: Stream | None = None) -> None:
        """Copy the live SSM state into a snapshot page of ``nid`` (best effort), on
        ``stream`` (the commit's: where the state was written). Pages pushed down to make
        room are copied after ``stream``'s work queued so far, and it waits for them."""
        L = self._levels
        L.begin(stream)
        try:
            self._snapshot_states(nid, stream)
        finally:
            L.end(stream)

    def _snapshot_states(self, nid: int, stream: Stream | None) -> None:
        ctx = self._ctx
        L = self._levels
        for g in ctx.ssm_groups:
            live = self._ssm[g]
            if live < 0 or self._tree.pages[nid, g] >= 0 or not ctx.life_cycles[g].publishes:
                continue
            if not L.can_take({L.pool_group_of(g): 1}):
                continue
            try:
                snap = L.take(g, 1)
            except OutOfPagesError:  # a write of held pages below failed: no snapshot
                continue
            # (The snapshot page is in no Batch table: its lock goes without waiting for
            # the Batch's readers.)
            if not self._tree.live(np.asarray([nid]))[0]:
                # Making room evicted the node's last page and the node went with it.
                L.change(snap, -1, 0)
                return
            try:
                L.copy_blocks(g, snap, np.asarray([live]), stream)
                L.publish(snap, np.asarray([nid]), g)
            finally:  # (an error in the copy or an event sink: the page is not leaked)
                L.change(snap, -1, 0)

    def _publish_tail(self) -> int:
        """Publish the trailing partial block; returns the node ending at the cache's
        known tokens (for the SSM snapshot), or ``NO_NODE``."""
        tree = self._tree
        tpb = self._tpb
        n = self._tokens.n
        b = n // tpb
        if n % tpb == 0:
            # (The node is ours only while its key still names it: ids are recycled.)
            return self._parent_node(b) if b and self._published >= b else NO_NODE
        if self._published < b:
            return NO_NODE
        parent = self._parent_node(b)
        if parent == NO_NODE:
            return NO_NODE
        part_t = self._tokens.tail(b * tpb)
        if self._tokens.has_digests and not all(isinstance(t, int) for t in part_t):
            return NO_NODE  # partial blocks with multimodal items are not shared
        for child in tree.children_starting(parent, part_t[0]):
            if tree.mm[child]:  # digests (as int32 ids here) cover no plain partial block
                continue
            ctoks = tree.block_tokens(child)
            if ctoks[: len(part_t)] == part_t:
                return child if len(ctoks) == len(part_t) else NO_NODE
        self._supersede_partials(parent, part_t)
        nid = tree.add_partial(parent, part_t)
        a = self._arena
        published = False
        for g in self._ctx.publish_groups:
            pages_g = self._pages[g]
            mine = pages_g[b] if b < len(pages_g) else -1
            # A page lost to a storage failure (level -1) holds no data: never publish it.
            if mine >= 0 and a.node[mine] < 0 and a.level[mine] >= 0:
                if self._priority_cb is None:
                    a.priority[mine] = PARTIAL_BLOCK_PRIORITY
                self._levels.publish_one(mine, nid, g)
                published = True
        if not published and not self._state_to_publish():
            tree.collect(np.asarray([nid]))
            return NO_NODE
        return nid  # (a node left with no page at all is collected by the caller)

    def _state_to_publish(self) -> bool:
        """Whether close publishes a live SSM state at the cache's known tokens: then the
        node ending there is kept for it even when no attention group publishes a page
        into it (a pure SSM model, or SSM with only PRIVATE attention)."""
        ctx = self._ctx
        if self._tokens.n != self._history:
            return False
        level = self._arena.level
        return any(self._ssm[g] >= 0 and level[self._ssm[g]] >= 0
                   and ctx.life_cycles[g].publishes for g in ctx.ssm_groups)

    def _collect_bare_tail(self) -> None:
        """Remove the nodes of this cache's chain that were left holding no page (a model
        that publishes only SSM states keys its full blocks into pageless nodes at commit;
        those no snapshot ended up in must not stay in the tree). Only when no other open
        cache of the same scope may be building on them: it would lose its chain (and
        the ids could be handed out again under it)."""
        ctx = self._ctx
        if not ctx.publish_groups and self._published and \
                ctx.open_roots.get(self._root_key, 0) <= 1:
            nid = self._parent_node(self._published)
            if nid != NO_NODE and not self._tree.has_pages(nid):
                self._tree.collect(np.asarray([nid]))

    def _demote_leaf(self) -> None:
        """Give the leaf block's pages :data:`LEAF_BLOCK_PRIORITY` (see there) and mark
        them ``demoted`` (a column of the page's row: it goes when the page id is handed
        out again, and ``Levels.claim`` undoes it when another request shares the page)."""
        b = self._published - 1
        nodes = self._nodes
        if b < 0 or len(nodes) <= b or self._priority_cb is not None:
            return
        nid = nodes[b]
        a = self._arena
        for g in self._ctx.publish_groups:
            pages_g = self._pages[g]
            if b < len(pages_g):
                pid = pages_g[b]
                # Ours (published into this node by this cache) and never claimed by another.
                if pid >= 0 and a.node[pid] == nid and not a.reused[pid]:
                    a.priority[pid] = LEAF_BLOCK_PRIORITY
                    a.demoted[pid] = 1

    def _publish_at_close(self) -> None:
        """The leaf block's priority, the trailing partial block, and the live SSM state
        where it ends exactly at the cache's history."""
        self._demote_leaf()
        nid = self._publish_tail()
        ctx = self._ctx
        if not ctx.ssm_groups or nid == NO_NODE or self._tokens.n != self._history or \
                self._tree.end(nid) != self._history:
            self._collect_bare_tail()
            return
        for g in ctx.ssm_groups:
            live = self._ssm[g]
            if live >= 0 and self._arena.level[live] >= 0 and self._tree.pages[nid, g] < 0 \
                    and ctx.life_cycles[g].publishes:
                self._levels.publish(np.asarray([live]), np.asarray([nid]), g)
        if not self._tree.has_pages(nid):  # nothing went into it after all
            self._tree.collect(np.asarray([nid]))
        self._collect_bare_tail()
