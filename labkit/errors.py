"""Errors that users see.

Every mistake a user can make (a misspelt preset, an impossible layout, a knob out of
range) is reported *before* anything runs, by one of these exceptions. Their messages
name the offending thing and, where there is a closed set of choices, list the allowed
values. The CLI turns them into exit code 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad preset name, layout string or engine knob."""


class OversizeError(ConfigError):
    """A call no rank of the deployment can ever hold (its KV past a rank's pool): a
    replay refuses the trace, or skips such calls (``on_oversize="skip"``)."""


def unknown_choice(what: str, value: object, allowed) -> ConfigError:
    """The standard message for a value outside a closed set of choices."""
    allowed = ", ".join(str(a) for a in allowed)
    return ConfigError(f"unknown {what} {value!r}; allowed: {allowed}")
