"""What a store's root holds: its kind (:class:`RootState`) and its entries sorted.

In: the names in a root (and whether a step directory has its manifest). Out: the
committed steps and the garbage (:func:`split_root`), or what the root is when it is no
store, for the messages that refuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from ..layout import is_garbage_name, parse_step_dirname

__all__ = ["RootState", "split_root"]


@dataclasses.dataclass(frozen=True)
class RootState:
    """What a store's root is (:meth:`Storage.root_state`).

    Attributes:
        kind: ``"store"``, ``"missing"``, ``"file"``, ``"blocked"`` (a file where a parent
            directory should be), ``"empty"`` (a directory with nothing in it) or
            ``"other"`` (a directory holding entries ckptstore never makes).
        sample: for ``"other"``: the first few of those entries, sorted.
        count: for ``"other"``: how many entries there are.
    """

    kind: str
    sample: tuple[str, ...] = ()
    count: int = 0

    def sample_text(self) -> str:
        """``'a', 'b', 'c' and 4 more`` for messages."""
        text = ", ".join(repr(n) for n in self.sample)
        more = self.count - len(self.sample)
        return f"{text} and {more} more" if more > 0 else text


def split_root(
    names: Iterable[str], has_manifest: Callable[[str], bool]
) -> tuple[list[int], list[str]]:
    """Sort the entries of a store's root: ``(committed steps ascending, garbage sorted)``.

    A step directory is committed when ``has_manifest(name)``, garbage otherwise; tmp and
    trash entries are garbage; anything else (the lock, the listing cache) is neither.
    """
    steps = []
    garbage = []
    for name in names:
        step = parse_step_dirname(name)
        if step is not None:
            if has_manifest(name):
                steps.append(step)
            else:
                garbage.append(name)
        elif is_garbage_name(name):
            garbage.append(name)
    return sorted(steps), sorted(garbage)
