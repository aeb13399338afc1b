"""Decode batches split into length groups, shared by the numpy and torch runners.

A decode step pads every sequence of an attention call to the longest one's blocks. One
long prompt joining short streams would make every stream read its length; grouping the
batch by blocks used bounds that padding (``PADDING_LIMIT``) at the cost of one attention
call per group.
"""

from __future__ import annotations

import numpy as np

PADDING_LIMIT = 2   # a decode group reads at most this many times the blocks its sequences use


def length_groups(used: np.ndarray) -> list[np.ndarray]:
    """Batch indices grouped by ``used`` (blocks each sequence reads) so that padding every
    sequence of a group to its longest reads at most ``PADDING_LIMIT`` times the blocks
    they use: one long prompt joining short streams is attended on its own instead of
    making every stream read its length. Every index is in exactly one group; each group's
    indices ascend (so a single group is ``0..B-1`` in order)."""
    order = np.argsort(used, kind="stable")
    groups, start, total = [], 0, 0
    for end, i in enumerate(order):
        total += int(used[i])
        if (end + 1 - start) * int(used[i]) > PADDING_LIMIT * total and end > start:
            groups.append(np.sort(order[start:end]))
            start, total = end, int(used[i])
    groups.append(np.sort(order[start:]))
    return groups
