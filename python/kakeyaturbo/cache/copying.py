"""How a :class:`~kakeyaturbo.cache.KakeyaCache` is copied, and why it is not pickled: a deep
copy that shares what never changes (:func:`copy_sharing`), and the pickle refusal that names the
way to disk (:class:`NotPickled`)."""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable


def copy_sharing(obj: Any, memo: Dict[int, Any], shared: Iterable[Any]) -> Any:
    """A deep copy of ``obj`` (``copy.deepcopy``'s ``memo``) in which each of ``shared``, where
    ``obj`` reaches it, is the object itself."""
    for s in shared:
        memo[id(s)] = s
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    for k, v in obj.__dict__.items():
        new.__dict__[k] = copy.deepcopy(v, memo)
    return new


class NotPickled:
    """A cache goes to disk with ``cache.save(path)``, not pickle: ``pickle.dumps(cache)`` and
    ``torch.save(cache, f)`` raise TypeError saying so (they met the model's hooks and weak
    references first: an AttributeError about a local function). ``copy.copy`` stays the
    shallow copy it was (``copy.deepcopy`` gives an independent cache)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"a {type(self).__name__} is not pickled: cache.save(path) writes what it holds to one "
                        "file and KakeyaCache.load(path, model) reads it back")

    def __copy__(self) -> Any:
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        return new
