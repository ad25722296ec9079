"""Is the broker new enough for this package? :func:`version_problem` applies the rules to
what the broker says about itself (``GetInfo``, :meth:`gpubroker.Broker.info`), and
:func:`gpubroker.connect` warns with a :class:`BrokerVersionWarning` naming the rule that
failed. The rules, in order:

``no-getinfo``
    The broker has no ``GetInfo`` at all (it predates API revision 2).
``api-revision``
    Its API revision is below :data:`REQUIRED_API_REVISION`, the one this package is
    written against: calls the package makes may be unknown to it.
``release``
    Its release and this package's are not semver-compatible: a different major version,
    or, while the major is 0, a different minor (a newer broker of the same series is
    fine, an older one may lack fields this package reads).

A warning, not an error: the calls that do work keep working. Silence it with
``warnings.filterwarnings("ignore", category=gpubroker.BrokerVersionWarning)``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Tuple

from . import _native
from .errors import BrokerError

__all__ = ["BrokerVersionWarning", "REQUIRED_API_REVISION", "version_problem"]

#: The broker API revision this package is written against.
REQUIRED_API_REVISION: int = _native.REQUIRED_API_REVISION


class BrokerVersionWarning(UserWarning):
    """The broker is older than (or of another release series than) this package needs.

    Attributes:
        rule: which rule failed (``"no-getinfo"``, ``"api-revision"`` or ``"release"``).
    """

    def __init__(self, message: str, rule: str):
        super().__init__(message)
        self.rule = rule


def _release(version: str) -> Optional[Tuple[int, int]]:
    m = re.match(r"^v?(\d+)\.(\d+)", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_problem(
    info: Optional[Mapping[str, Any]],
    package_version: Optional[str] = None,
    required_api_revision: Optional[int] = None,
) -> Optional[Tuple[str, str]]:
    """``(rule, message)`` for the first rule the broker fails, or ``None``.

    Args:
        info: the broker's :meth:`~gpubroker.Broker.info`, or ``None`` when it has no
            ``GetInfo``.
        package_version: this package's version (default: ``gpubroker.__version__``).
        required_api_revision: default :data:`REQUIRED_API_REVISION`.
    """
    package_version = package_version or _native.__version__
    required = REQUIRED_API_REVISION if required_api_revision is None else required_api_revision
    if info is None:
        return (
            "no-getinfo",
            f"the broker predates API revision {required} (it has no GetInfo), which "
            f"gpubroker {package_version} needs; some calls may fail as unimplemented: "
            "upgrade the broker (rule: no-getinfo)",
        )
    version = str(info.get("version", ""))
    revision = int(info.get("api_revision", 0))
    if revision < required:
        return (
            "api-revision",
            f"the broker (release {version}, API revision {revision}) is older than "
            f"gpubroker {package_version} needs (API revision {required}); some calls may "
            "fail as unimplemented: upgrade the broker (rule: api-revision)",
        )
    ours, theirs = _release(package_version), _release(version)
    if ours and theirs and (ours[0] != theirs[0] or (ours[0] == 0 and ours[1] != theirs[1])):
        return (
            "release",
            f"the broker's release {version} and gpubroker {package_version} are not "
            "semver-compatible (rule: release — the same major version, and the same minor "
            "while the major is 0); use a gpubroker of the broker's series",
        )
    return None


def check(broker: Any, stacklevel: int = 3) -> Optional[BrokerVersionWarning]:
    """Asks `broker` for its info and warns about the first rule it fails; returns the
    warning given (``None`` when it passes, or when ``GetInfo`` failed for a reason the
    broker's real calls will report, e.g. a bad token)."""
    import warnings

    try:
        info: Optional[Mapping[str, Any]] = broker.info()
    except BrokerError as e:
        if e.code != "UNIMPLEMENTED":
            return None
        info = None
    problem = version_problem(info)
    if problem is None:
        return None
    rule, message = problem
    w = BrokerVersionWarning(message, rule)
    warnings.warn(w, stacklevel=stacklevel)
    return w
