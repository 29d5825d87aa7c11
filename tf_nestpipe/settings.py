"""Every environment variable tf_nestpipe reads, declared once, parsed one way.

Each variable is a `Setting` in `REGISTRY`: its name (always under the one prefix
`TF_NESTPIPE_`), its type, its default, its meaning and who sets it. Code reads a variable only
through its setting (`settings.EXIT_GRACE_SECONDS.value()`), so a bad value is refused the same
way everywhere, naming the variable, the value and what it must be; the configuration reference
in the docs is generated from `REGISTRY` (`markdown_table()`).

Variables once spelled `NESTPIPE_*` are still read under that name for one release, with a
`DeprecationWarning` naming the new one; when both are set the new one wins.

This module uses only the standard library, so every layer of the package may import it.
"""
import math
import os
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

PREFIX = "TF_NESTPIPE_"
LEGACY_PREFIX = "NESTPIPE_"


class SettingError(ValueError):
    """An environment variable holds a value its setting refuses; the message names the
    variable, the value and what it must be."""


class Setting:
    """One environment variable: how to read it and what it means.

    Args:
        suffix: The name after `PREFIX` (e.g. "EXIT_GRACE_SECONDS").
        type_name: What the value is, as the docs table shows it (e.g. "seconds").
        parse: Turns the variable's text into its value; raises ValueError (with a message
            saying what the value must be) for text it refuses.
        default: The value when the variable is unset or empty.
        meaning: One sentence: what the value does.
        set_by: "user" for a variable a user sets; otherwise who sets it (e.g. "launcher"),
            for variables tf_nestpipe passes between its own processes.
        legacy: The variable's deprecated former name (still read for one release), or True for
            `NESTPIPE_<suffix>`, or None.
        default_text: The default as the docs show it, where `default` depends on the machine.
    """

    def __init__(self, suffix: str, type_name: str, parse: Callable[[str], Any], default: Any,
                 meaning: str, set_by: str = "user", legacy=None,
                 default_text: Optional[str] = None):
        self.name = PREFIX + suffix
        self.legacy_name = LEGACY_PREFIX + suffix if legacy is True else legacy
        self.type_name = type_name
        self._parse = parse
        self._default = default
        self.meaning = meaning
        self.set_by = set_by
        self.default_text = default_text if default_text is not None else _show(default)

    @property
    def default(self) -> Any:
        """The value when the variable is unset or empty (computed now where it depends on the
        machine, e.g. the home directory)."""
        return self._default() if callable(self._default) else self._default

    def raw(self, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The variable's text in `environ` (default: `os.environ`), or None when unset or empty.

        Args:
            environ: The environment to read; `os.environ` when None.

        Returns:
            The text under `name`, else (warning that the spelling is deprecated) under
            `legacy_name`, else None.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(self.name)
        if text:
            return text
        if self.legacy_name and environ.get(self.legacy_name):
            warnings.warn("%s is deprecated and will stop being read in the next release; set %s "
                          "instead" % (self.legacy_name, self.name), DeprecationWarning,
                          stacklevel=3)
            return environ[self.legacy_name]
        return None

    def value(self, environ: Optional[Mapping[str, str]] = None, default: Any = None) -> Any:
        """The variable's value in `environ` (default: `os.environ`), else the default.

        Args:
            environ: The environment to read; `os.environ` when None.
            default: The value when the variable is unset or empty (None: the setting's own).

        Returns:
            The parsed value, or the default when the variable is unset or empty.

        Raises:
            SettingError: The variable holds a value the setting refuses; the message names the
                variable, its value and what it must be.
        """
        text = self.raw(environ)
        if text is None:
            return self.default if default is None else default
        try:
            return self._parse(text)
        except ValueError as error:
            raise SettingError("%s %s, got %r" % (self.name, error, text)) from None

    def is_set(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """Whether the variable (or its deprecated spelling) is set to a non-empty value."""
        return self.raw(environ) is not None

    def __repr__(self):
        return "Setting(%s)" % self.name


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def seconds(minimum: float, meaning_of_minimum: str = "", strict: bool = False):
    """A parser of a number of seconds >= `minimum` (> `minimum` when `strict`).

    Args:
        minimum: The least value accepted.
        meaning_of_minimum: What `minimum` does (e.g. "0 turns the guard off"), for the message.
        strict: Whether `minimum` itself is refused.

    Returns:
        A function from text to float that raises ValueError for other text.
    """
    bound = "%s %g" % (">" if strict else ">=", minimum)
    hint = " (%s)" % meaning_of_minimum if meaning_of_minimum else ""

    def parse(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (number > minimum if strict else number >= minimum) or math.isinf(number):
            raise ValueError("must be a number of seconds %s%s" % (bound, hint))
        return number
    parse.type_name = "seconds %s" % bound
    return parse


def choice(*choices: str):
    """A parser that accepts one of `choices` (exactly as spelled)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError("must be one of %s" % ", ".join(choices))
        return text
    parse.type_name = " | ".join(choices)
    return parse


def flag(text: str) -> bool:
    """"1" is true, "0" false; anything else is refused."""
    if text not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return text == "1"


flag.type_name = "0 | 1"


def text_value(text: str) -> str:
    """Any non-empty text, unchanged."""
    return text


text_value.type_name = "text"


def port(text: str) -> int:
    """A TCP port number, 1-65535."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError("must be a TCP port number 1-65535")
    return int(text)


port.type_name = "port"


def path(text: str) -> str:
    """A file system path; `~` is expanded."""
    return os.path.expanduser(text)


path.type_name = "path"


REGISTRY: Dict[str, Setting] = {}


def register(suffix: str, parse: Callable[[str], Any], default: Any, meaning: str,
             **kwargs) -> Setting:
    """Declares the variable `PREFIX + suffix` (see `Setting` for the arguments).

    Returns:
        The new `Setting`, also kept in `REGISTRY` under its full name.

    Raises:
        ValueError: A variable of that name is already declared.
    """
    setting = Setting(suffix, getattr(parse, "type_name", parse.__name__), parse, default,
                      meaning, **kwargs)
    if setting.name in REGISTRY:
        raise ValueError("%s is declared twice" % setting.name)
    REGISTRY[setting.name] = setting
    return setting


def lookup(name: str) -> Setting:
    """The setting of the variable `name` (full name, e.g. "TF_NESTPIPE_STARTUP_TIMEOUT").

    Raises:
        KeyError: No such variable is declared; the message lists those that are.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError("%s is not a tf_nestpipe environment variable; the declared ones are %s"
                       % (name, ", ".join(sorted(REGISTRY)))) from None


# ---------------------------------------------------------------------------------------------
# The variables. A new one is declared here, and nowhere else.

LAUNCH_OUTPUT_MODES: Tuple[str, ...] = ("first", "all")

STARTUP_TIMEOUT = register(
    "STARTUP_TIMEOUT", seconds(0, strict=True), 30.0,
    "How long every task of a cluster waits at start-up for the others to report the same "
    "cluster, before it fails naming the task that never came.")
HEARTBEAT_TIMEOUT_SECONDS = register(
    "HEARTBEAT_TIMEOUT_SECONDS",
    seconds(1, "how long a silent worker may go before the cluster is aborted"), 30.0,
    "How long a worker may send no heartbeat to the coordination service before the cluster "
    "declares it dead and aborts every pending collective.")
EXIT_GRACE_SECONDS = register(
    "EXIT_GRACE_SECONDS", seconds(0, "0 turns the exit guard off"), 15.0,
    "How long a worker's shutdown may take after an uncaught error before it is forced to exit "
    "(printing every thread's stack); 0 never forces it.")
PREEMPTION_CHECK_SECONDS = register(
    "PREEMPTION_CHECK_SECONDS", seconds(0, "0 checks at every step"), 1.0,
    "About how often (seconds of training) the workers of a `fit` with "
    "`BackupAndRestore(save_before_preemption=True)` agree whether one got SIGTERM (one tiny "
    "all-gather each time); a preemption save comes up to this much later.")
LAUNCH_OUTPUT = register(
    "LAUNCH_OUTPUT", choice(*LAUNCH_OUTPUT_MODES), "first",
    "Which tasks' output `python -m tf_nestpipe.launch` shows on the console: the first "
    "training task's, or all; every task's output is also written to its log file.")
CACHE = register(
    "CACHE", path, lambda: os.path.join(os.path.expanduser("~"), ".cache", "tf_nestpipe"),
    "Where downloaded data sets (MovieLens) and this machine's calibrated costs are kept.",
    default_text="~/.cache/tf_nestpipe")
PLAN_COSTS = register(
    "PLAN_COSTS", path, lambda: os.path.join(CACHE.value(), "plan_costs.json"),
    "The collective costs file `python -m tf_nestpipe.plan calibrate` writes and the placement "
    "planner prefers to the package's defaults (e.g. a file on a volume every host mounts).",
    default_text="$TF_NESTPIPE_CACHE/plan_costs.json")
RESTARTED_TASK = register(
    "RESTARTED_TASK", flag, False,
    "Marks a worker server the launcher restarted, which skips the start-up cluster check "
    "(the cluster was checked when it first started).", set_by="launcher")
BIND_HOST = register(
    "BIND_HOST", text_value, None,
    "The numeric address a task's server listens on, read by the bind() interposer "
    "(`_nestpipe_bind.so`) preloaded into each task.", set_by="launcher", legacy=True)
BIND_PORT = register(
    "BIND_PORT", port, None,
    "The port whose wildcard bind the interposer narrows to `TF_NESTPIPE_BIND_HOST`.",
    set_by="launcher", legacy=True)


def positive_number(kind=float):
    """A parser of a number > 0 of type `kind` (float or int)."""
    def parse(text: str):
        try:
            number = kind(text)
        except ValueError:
            number = None
        if number is None or not number > 0 or (kind is float and math.isinf(number)):
            raise ValueError("must be %s > 0" % ("a number" if kind is float else "an integer"))
        return number
    parse.type_name = "%s > 0" % ("number" if kind is float else "integer")
    return parse


def port_or_any(text: str) -> int:
    """A TCP port number, or 0 for any free port."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError("must be a TCP port number 0-65535 (0: any free port)")
    return int(text)


port_or_any.type_name = "port"

# The transport between the workers (read by `tf_nestpipe.transport_config.TransportConfig`,
# whose fields override them).
TRANSPORT_TIMEOUT = register(
    "TRANSPORT_TIMEOUT", seconds(0, strict=True), 600.0,
    "How long a collective may wait for a peer that is alive but does not make the matching "
    "call; every worker then fails naming that peer and the call.")
TRANSPORT_CONNECT_TIMEOUT = register(
    "TRANSPORT_CONNECT_TIMEOUT", seconds(0, strict=True), 30.0,
    "How long start-up may take to open every connection of the socket mesh.",
    legacy="NESTPIPE_SOCKET_CONNECT_TIMEOUT")
TRANSPORT_HELLO_TIMEOUT = register(
    "TRANSPORT_HELLO_TIMEOUT", seconds(0, strict=True), 5.0,
    "How long one mesh connection may take to authenticate.")
TRANSPORT_STALL_SECONDS = register(
    "TRANSPORT_STALL_SECONDS", seconds(0, strict=True), 20.0,
    "How long a peer may send nothing at all, not even a heartbeat, before it counts as dead.",
    legacy="NESTPIPE_SOCKET_STALL_SECONDS")
TRANSPORT_MAX_MESSAGE_BYTES = register(
    "TRANSPORT_MAX_MESSAGE_BYTES", positive_number(int), 1 << 32,
    "The largest frame a peer may announce.")
TRANSPORT_MAX_BUFFERED_BYTES = register(
    "TRANSPORT_MAX_BUFFERED_BYTES", positive_number(int), 1 << 30,
    "Bytes of frames arriving before their call starts that a worker buffers in all.")
TRANSPORT_PORT = register(
    "TRANSPORT_PORT", port_or_any, 0,
    "The port the socket mesh listens on (0: any free port); fix it where a firewall or a "
    "Kubernetes NetworkPolicy admits only known ports.")
TRANSPORT_LISTEN_HOST = register(
    "TRANSPORT_LISTEN_HOST", text_value, None,
    "The address the socket mesh listens on (unset: this worker's `TF_CONFIG` host).")
TRANSPORT_SECRET = register(
    "TRANSPORT_SECRET", text_value, None,
    "The job's secret, which mesh peers prove they hold before they may join; "
    "`python -m tf_nestpipe.launch` makes one per job.")
TRANSPORT_SECRET_FILE = register(
    "TRANSPORT_SECRET_FILE", path, None,
    "A file holding the job's secret (e.g. a mounted Kubernetes Secret), where "
    "`TF_NESTPIPE_TRANSPORT_SECRET` is unset.")
TRANSPORT_HIERARCHICAL = register(
    "TRANSPORT_HIERARCHICAL", choice("auto", "on", "off"), "auto",
    "Whether all-to-alls go within each host first, then across hosts between workers of the "
    "same local rank (auto: from 64 workers on, where several share a host).")
TRANSPORT_LOCAL_WORKERS = register(
    "TRANSPORT_LOCAL_WORKERS", positive_number(int), None,
    "Workers per host for the hierarchical all-to-all (unset: workers whose TF_CONFIG hosts "
    "resolve to the same address share a host); consecutive indices form a host.")


def markdown_table(set_by: Optional[str] = None) -> str:
    """The declared variables as a Markdown table (the docs' configuration reference).

    Args:
        set_by: Only the variables set by this party ("user", "launcher"); all when None.

    Returns:
        A table with the columns variable, type, default and meaning, sorted by name.
    """
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for name in sorted(REGISTRY):
        setting = REGISTRY[name]
        if set_by is not None and setting.set_by != set_by:
            continue
        meaning = setting.meaning
        if setting.set_by != "user":
            meaning = "(Set by the %s, not by users.) %s" % (setting.set_by, meaning)
        if setting.legacy_name:
            meaning += " Formerly `%s` (still read, deprecated)." % setting.legacy_name
        rows.append("| `%s` | %s | %s | %s |" % (name, setting.type_name.replace("|", "\\|"),
                                                 setting.default_text, meaning))
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
