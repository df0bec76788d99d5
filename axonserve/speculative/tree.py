"""Draft trees (EAGLE-2): draft j follows draft parents[j], -1 being the last known token (the
root); parents come before their children, so any prefix of a tree is a tree and a chain is
parents [-1, 0, 1, ...]. Shared by the scheduler, the verifier and the worker (no torch here)."""

from __future__ import annotations


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[j + 1]: the drafts that follow draft j (children[0]: the root's), in index order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        kids[p + 1].append(j)
    return kids


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of the root (0), then of each draft (its parent's + 1)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p + 1] + 1)
    return depth


def tree_walk(drafts: list[int], parents: list[int], tokens: list[int]) -> list[int]:
    """The drafts (indices) that hold `tokens` in turn from the root, the first such child at
    each step (as verification walks), until a token no child holds."""
    kids, node, path = tree_children(parents), -1, []
    for tok in tokens:
        node = next((c for c in kids[node + 1] if drafts[c] == tok), -1)
        if node < 0:
            break
        path.append(node)
    return path


def tree_path(drafts: list[int], parents: list[int], accepted: list[int]) -> list[int]:
    """The drafts a verification accepted, from its output tokens (the last one is sampled)."""
    return tree_walk(drafts, parents, accepted[:-1])
