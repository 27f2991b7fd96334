"""Data loaders across a manager's save and restore, so that a resume repeats the uninterrupted run.

A torch DataLoader without a ``generator`` draws a seed from the global torch RNG each time it
makes an iterator. A run resumed mid-epoch makes one iterator more than the run it repeats (the
uninterrupted one goes on with the iterator it has), and that draw shifts every random number
after it (dropout). :class:`LoaderGuard` has each torchdata ``StatefulDataLoader`` in the state
make its next iterator before the RNG states are captured (save) or restored (restore), and the
training loop's ``iter()`` then returns that iterator without a draw. Loaders whose order no
checkpoint holds (a plain DataLoader that shuffles, a StatefulDataLoader over torch's
``RandomSampler`` or left out of the state) are named in a warning at the first save.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, RandomSampler

from ..state import RankLocal

log = logging.getLogger(__name__)

_FIX = ("use torchdata's StatefulDataLoader (torchdata.stateful_dataloader; it takes the same arguments, "
        "shuffle=True included) and put it in the state under 'dataloader'")


class LoaderGuard:
    """What a manager does for the data loaders in its state at each save and restore (see the
    module docstring); it warns about loaders a resume cannot replay once, at its first save."""

    def __init__(self) -> None:
        self.checked = False

    def before_save(self, state: Any, caller: types.FrameType | None) -> None:
        """Before the RNG states are captured: warn (at the first save only) about loaders a resume
        cannot replay, looking in ``state`` and in the locals of ``caller`` and the frames above it;
        then settle the state's loaders (see :func:`settle`)."""
        if not self.checked:
            self.checked = True
            problems = unreplayable(state, caller)
            if problems:
                log.warning("a resume from these checkpoints will not repeat the uninterrupted run: %s",
                            "; ".join(problems))
        settle(state)

    def after_load(self, state: Any) -> None:
        """After the loaders took their saved state, before the RNG states are restored."""
        settle(state)


def settle(state: Any) -> None:
    """Have each StatefulDataLoader at the top level of ``state`` that has no iterator make its next
    one now (what its own ``state_dict()`` does then), so that this iterator's draw from the global
    RNG comes before the RNG states are captured or restored, in the first run and the resumed one alike."""
    for loader in _top_values(state):
        if _is_stateful_loader(loader) and loader._iterator is None:
            loader.state_dict()


def unreplayable(state: Any, caller: types.FrameType | None) -> list[str]:
    """One line per loader whose order a resume cannot replay, found in ``state``'s top level or in
    the locals of ``caller`` and the frames above it (and one attribute or dict item below them)."""
    in_state = {id(v) for v in _top_values(state)}
    problems: dict[int, str] = {}
    for where, loader in _loaders(state, caller):
        if id(loader) in problems:
            continue
        why = _why_unreplayable(loader, id(loader) in in_state)
        if why:
            problems[id(loader)] = f"{where} {why}"
    return list(problems.values())


def _why_unreplayable(loader: DataLoader, in_state: bool) -> str | None:
    samplers = [loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    if not _is_stateful_loader(loader):
        if in_state:  # the save refuses a plain DataLoader in the state itself, naming the fix
            return None
        if any(type(s) is RandomSampler and s.generator is None for s in samplers):
            return ("is a torch DataLoader whose RandomSampler draws each epoch's order from the global RNG (no "
                    "generator=) and which keeps no position: no checkpoint can hold the epoch it is in, so a resume "
                    f"starts it over in another order; {_FIX}")
        return None
    if any(type(s) is RandomSampler for s in samplers):
        return ("is a StatefulDataLoader over torch's RandomSampler, which keeps no state: a resume replays the epoch "
                "in another order; pass shuffle=True instead of sampler=RandomSampler(...) (torchdata's own "
                "RandomSampler saves its order), or torchdata.stateful_dataloader.sampler.RandomSampler")
    if not in_state and any(_shuffles(s) for s in samplers):
        return ("is a StatefulDataLoader that shuffles but is not at the top level of the saved state, where the "
                "manager keeps its draws from the global RNG in step with a resume: put it there, under 'dataloader'")
    return None


def _shuffles(sampler: Any) -> bool:
    """Whether ``sampler`` draws a random order: a RandomSampler (torch's or torchdata's), or one
    told to shuffle (a DistributedSampler)."""
    return type(sampler).__name__ == "RandomSampler" or getattr(sampler, "shuffle", False) is True


def _is_stateful_loader(obj: Any) -> bool:
    module = sys.modules.get("torchdata.stateful_dataloader")  # no object is one unless torchdata is imported
    return module is not None and issubclass(type(obj), module.StatefulDataLoader)


def _top_values(state: Any) -> list[Any]:
    values = state.values() if isinstance(state, Mapping) else ()
    return [v.value if isinstance(v, RankLocal) else v for v in values]


def _loaders(state: Any, caller: types.FrameType | None) -> Iterator[tuple[str, DataLoader]]:
    """The DataLoaders met in ``state``'s top level and in the frames' locals, each with where it was met."""
    for key, value in zip(state, _top_values(state)) if isinstance(state, Mapping) else ():
        if issubclass(type(value), DataLoader):
            yield f"state[{key!r}]", value
    frame = caller
    try:
        while frame is not None:
            for name, value in list(frame.f_locals.items()):
                for where, obj in _with_members(str(name), value):
                    if issubclass(type(obj), DataLoader):
                        yield f"{where} (in {frame.f_code.co_name}())", obj
            frame = frame.f_back
    finally:
        del frame


def _with_members(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``value`` and, one level below it, a dict's items or an object's attributes (``self.loader``);
    modules, classes and functions are not looked into, and no property runs."""
    yield name, value
    if issubclass(type(value), (types.ModuleType, type, types.FunctionType, DataLoader, torch.Tensor)):
        return
    if issubclass(type(value), dict):
        members: Mapping[Any, Any] = value
    else:
        try:  # no custom __getattribute__ or __getattr__ runs
            members = object.__getattribute__(value, "__dict__")
        except AttributeError:
            return
    for key, member in list(members.items()):
        if issubclass(type(member), DataLoader):
            yield (f"{name}[{key!r}]" if members is value else f"{name}.{key}"), member
