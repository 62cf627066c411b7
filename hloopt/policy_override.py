"""Deciding the checkpoint policy of a program that does not take one.

Most training code never exposes its ``jax.checkpoint`` policy: transformers' Flax models call
``nn.remat`` with their own, Equinox/Haliax wrap ``jax.checkpoint`` deep inside a layer stack,
MaxText builds the policy from its config. All of them end in one place: at trace time JAX binds
the ``remat`` primitive (``remat2`` in jax 0.4-0.12) with the policy as a parameter, or, with
``jax_remat3`` on, builds a ``RematTraced`` primitive holding it. :func:`override_policies`
replaces that parameter for every checkpoint traced inside the ``with`` block, whichever
framework called ``jax.checkpoint`` and however it imported it::

    with override_policies(policy):
        compiled = jax.jit(step).lower(*args).compile()   # every checkpoint takes `policy`

Caches. jit caches traces, and ``jax.checkpoint`` caches the jaxpr of its body, keyed on the
function, its argument types and JAX's *trace context* (the configuration states that change
what tracing produces). A trace made with the program's own policies must not be reused inside
the block, nor one made inside it afterwards. Each block therefore sets a configuration state of
its own, part of the trace context, to a fresh token: every cache lookup inside misses, and the
entries made inside are never found outside (the state is back to ``None`` there). Where the
installed jax cannot register such a state, the block clears JAX's caches on entry and exit
(``jax.clear_caches()``), which is correct but throws away the user's compiled functions.

On exit, normally or by an exception, the primitive's binding is restored: the program's own
policies apply again to everything traced later.

Only the policy is replaced; ``prevent_cse``, static arguments and the checkpointed function stay
the program's. A program's nested checkpoints all take the same policy (a plan's policy is a
function of names and primitives over the whole step, so that is what it expects).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CheckpointsSeen", "override_policies", "remat3_enabled"]


@dataclasses.dataclass
class CheckpointsSeen:
    """What tracing inside :func:`override_policies` met: how many checkpoint regions were
    bound, and the policies the program itself gave them (by name)."""

    #: checkpoint regions traced (each ``jax.checkpoint`` call on each trace of its caller)
    count: int = 0
    #: the program's own policies, by name ("None" for ``jax.checkpoint`` without one)
    own_policies: Counter[str] = dataclasses.field(default_factory=Counter)

    def record(self, own: Any) -> None:
        self.count += 1
        self.own_policies[policy_label(own)] += 1


def policy_label(policy: Any) -> str:
    """A short human name for a checkpoint policy (``dots_saveable``, ``None``, ...)."""
    if policy is None:
        return "None"
    name = getattr(policy, "__name__", None) or getattr(getattr(policy, "func", None), "__name__", None)
    return str(name or type(policy).__name__)


_lock = threading.RLock()
_tokens = itertools.count(1)
#: one token per policy object, so that a policy imposed again finds the traces made with it
#: (a step wrapped by hloopt.apply_plan is traced once, not on every call); never reused
_token_of: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_state: Any = None
_state_tried = False


def _trace_state() -> Any:
    """A JAX configuration state in the trace context (see the module docstring), or None."""
    global _state, _state_tried
    if not _state_tried:
        _state_tried = True
        try:
            from jax._src import config as jax_config

            _state = jax_config.optional_string_state(
                name="hloopt_policy_override", default=None,
                help="set by hloopt while it decides the checkpoint policies of a traced program",
                include_in_trace_context=True)
        except Exception:  # an older/newer jax without this API: fall back to clearing caches
            _state = None
    return _state


def remat3_enabled() -> bool:
    """Whether ``jax_remat3`` is on (JAX's name-only policy implementation, where it exists).
    False in a process that has not imported jax (nothing there can have turned it on), so that
    hloopt's commands on plan files never import it."""
    if "jax" not in sys.modules:
        return False
    import jax

    try:
        return bool(jax.config.jax_remat3)  # type: ignore[attr-defined]
    except AttributeError:
        return False


#: the blocks open now, innermost last: (policy, what it saw)
_active: list[tuple[Any, CheckpointsSeen]] = []
#: JAX's own bindings while a block is open: (remat_p.bind, RematTraced.__init__ or None)
_originals: tuple[Any, Any] | None = None


@contextlib.contextmanager
def override_policies(policy: Callable[..., Any] | None) -> Iterator[CheckpointsSeen]:
    """Every ``jax.checkpoint`` traced inside the block takes ``policy`` (see the module docstring).

    Yields a :class:`CheckpointsSeen` that counts the checkpoint regions traced inside. ``None``
    is JAX's default (save nothing, recompute everything). Blocks nest: the innermost decides.
    """
    seen = CheckpointsSeen()
    with _lock:
        if not _active:
            _install()
        _active.append((policy, seen))
        state = _trace_state()
        context = state(_token(policy)) if state is not None else contextlib.nullcontext()
        if state is None:
            _clear_caches()
        try:
            with context:
                yield seen
        finally:
            _active.pop()
            if not _active:
                _uninstall()
            if state is None:
                _clear_caches()


def _install() -> None:
    """Route JAX's checkpoint bindings through the innermost open block's policy."""
    global _originals
    from jax._src import ad_checkpoint

    remat_p = ad_checkpoint.remat_p
    remat_traced = getattr(ad_checkpoint, "RematTraced", None)
    old_bind = remat_p.bind
    old_init = remat_traced.__init__ if remat_traced is not None else None
    _originals = (old_bind, old_init)

    def bind(*args: Any, **params: Any) -> Any:
        policy, seen = _active[-1]
        # the jvp/transpose/batching rules re-bind with the policy already replaced
        if params.get("policy") is not policy:
            seen.record(params.get("policy"))
            params["policy"] = policy
        return old_bind(*args, **params)

    def init(self: Any, jaxpr: Any, own: Any = None, *rest: Any, **kw: Any) -> None:
        policy, seen = _active[-1]
        if own is not policy:
            seen.record(own)
        assert old_init is not None
        old_init(self, jaxpr, policy, *rest, **kw)

    remat_p.bind = bind  # type: ignore[method-assign]
    if remat_traced is not None:
        remat_traced.__init__ = init  # type: ignore[method-assign]


def _uninstall() -> None:
    global _originals
    from jax._src import ad_checkpoint

    assert _originals is not None
    old_bind, old_init = _originals
    ad_checkpoint.remat_p.bind = old_bind  # type: ignore[method-assign]
    if old_init is not None:
        ad_checkpoint.RematTraced.__init__ = old_init  # type: ignore[method-assign]
    _originals = None


def _token(policy: Any) -> str:
    try:
        token = _token_of.get(policy)
        if token is None:
            token = _token_of[policy] = str(next(_tokens))
        return token
    except TypeError:  # not weakly referenceable (or not hashable): a fresh token each time
        return str(next(_tokens))


def _clear_caches() -> None:
    import jax

    jax.clear_caches()
