"""Hook specifications for pagedcore plugins, written the way pytest writes its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionBackend

PROJECT_NAME = "pagedcore"
#: Entry-point group a backend distribution registers under.
ENTRY_POINT_GROUP = "pagedcore.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:  # type: ignore[empty-body]
    """Return the attention backends this plugin provides.

    Each item must be a subclass of :class:`pagedcore.AttentionBackend` with a unique,
    non-empty ``name`` and every abstract method implemented; a plugin whose backends fail
    these checks is recorded with the reason and skipped.

    An entry point in the ``pagedcore.backends`` group names the module (or object) that holds
    this hook implementation::

        [project.entry-points."pagedcore.backends"]
        mybackend = "my_package.plugin"

    :return: the backend classes, in any order.
    """
