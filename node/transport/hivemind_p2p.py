"""The one place that reaches into hivemind's private API, and the version of hivemind it was written against.

hivemind's public `P2P` and `DHTNode` cover what hivemind itself needs (handlers, calls to them, the daemon it
starts); the node needs a few things more, and gets them from attributes hivemind does not promise to keep: dialing
a peer at given addresses, opening a stream by a libp2p protocol id, starting p2pd in a session of its own and with
flags of our choosing, handing a DHT node a daemon it should stop with itself, reaching that daemon's process, and
ending quietly an incoming stream whose daemon died before its header. Each is one function here, whose docstring
says what the public API lacks. Everything else in the node (and every test that fakes a dial) goes through these
functions, so that a hivemind upgrade is checked here, function by function, and nowhere else.

Importing this module checks the installed hivemind against HIVEMIND_VERSION (pyproject.toml pins the same one):
private attributes change without notice between releases, and a node that dialed through a renamed one would
fail later, in the middle of a round, as an AttributeError far from its cause. A different version is refused at
once with `HivemindVersionError`, in one line naming both versions.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

log = logging.getLogger(__name__)

HIVEMIND_VERSION = "1.1.12"  # the release whose private attributes this module uses; pyproject.toml pins it


class HivemindVersionError(ImportError):
    """The installed hivemind is not the release this module was written against."""


def check_hivemind_version(found: str | None) -> None:
    """Refuse any hivemind but HIVEMIND_VERSION (`found` None: not installed), in one readable line."""
    if found != HIVEMIND_VERSION:
        raise HivemindVersionError(
            f"hivemind {found or '(not installed)'} found, but node/transport/hivemind_p2p.py uses private parts of "
            f"hivemind {HIVEMIND_VERSION}: pip install hivemind=={HIVEMIND_VERSION} (pyproject.toml pins it)"
        )


def _installed_hivemind_version() -> str | None:
    try:
        return version("hivemind")
    except PackageNotFoundError:
        return None


check_hivemind_version(_installed_hivemind_version())  # before hivemind's code is loaded at all

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()  # before any hivemind import: keeps its protobuf names out of libp2p's way

from hivemind.p2p import P2P  # noqa: E402
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient  # noqa: E402

if TYPE_CHECKING:
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr


async def connect(p2p: P2P, peer_id: PeerID, maddrs: Sequence[Multiaddr]) -> None:
    """Have our daemon connect to `peer_id`, dialing `maddrs` (none: the addresses its peerstore or DHT knows).

    Why private (`P2P._client.connect`): hivemind's P2P dials only its `initial_peers`, once, at `create`, and
    `call_binary_stream_handler` opens a stream only to a peer the daemon can already route to; nothing public
    dials a peer at the addresses its signed record gives. Raises what p2pd answers (P2PDaemonError, ControlFailure)."""
    await p2p._client.connect(peer_id, list(maddrs))


async def open_protocol_stream(
    p2p: P2P, peer_id: PeerID, protocol: str
) -> tuple[object, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a stream to `peer_id` speaking the libp2p protocol `protocol` (not a hivemind handler); (info, reader,
    writer) as p2pd returns them.

    Why private (`P2P._client.stream_open`): the public `call_binary_stream_handler` promises a stream to a handler
    that a hivemind peer added by name; that 1.1.12 passes the name on unchanged is not a promise. The node speaks
    go-libp2p's own circuit relay protocol (protocol/relay.py) to a relay, which no hivemind handler serves."""
    return await p2p._client.stream_open(peer_id, (protocol,))


# What p2pd's process runs before it becomes p2pd (os.execv: the same pid, so hivemind's terminate reaches the daemon):
# a session of its own, so that a terminal's Ctrl-C, which goes to the node's whole process group, reaches the node
# only, and the node stops its daemon after it has saved (a daemon that died first left the node's shutdown
# tracebacks and a 10 s wait); and, on Linux, SIGTERM when the node dies (PR_SET_PDEATHSIG, kill -9 too), which
# the process group no longer brings it. argv: the node's pid (a node that died before prctl is seen), then p2pd's.
DAEMON_LAUNCHER = (
    "import os, signal, sys\n"
    "os.setsid()\n"
    "if sys.platform == 'linux':\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


async def create_p2p(daemon_flags: dict[str, bool | int | str] | None = None, **options) -> P2P:
    """`P2P.create(**options)`, its p2pd started through DAEMON_LAUNCHER (in a session of its own, and stopped when
    this process dies), with `daemon_flags` added to p2pd's command line (`{"relayDiscovery": False}` is
    `-relayDiscovery=0`, as hivemind writes its own flags).

    Why private (`P2P._make_process_args`, overridden in a subclass): `P2P.create` starts p2pd in the caller's
    process group and passes it only the flags it has parameters for; nothing public changes how the process starts
    or passes the daemon's other flags (`-relayDiscovery`: node/transport/reachability.py)."""
    flags = dict(daemon_flags or {})

    class LaunchedP2P(P2P):
        @classmethod
        def _make_process_args(cls, *args, **kwargs):
            p2pd = P2P._make_process_args(*args, **kwargs, **flags)
            return [sys.executable, "-I", "-S", "-c", DAEMON_LAUNCHER, str(os.getpid()), *p2pd]

    return await LaunchedP2P.create(**options)


def hand_daemon_to(dht_node) -> None:
    """Make `dht_node` (a hivemind DHTNode created with `p2p=`) shut the daemon it was handed down with itself.

    Why private (`DHTNode._should_shutdown_p2p`): a DHTNode stops at its `shutdown` only a daemon it started, and a
    daemon started the node's way (`create_p2p`) must be handed to it; nothing public says the node owns it now."""
    dht_node._should_shutdown_p2p = True


async def start_dht_node(dht_node_class, dht_options: dict, p2p_options: dict, daemon_flags=None):
    """`dht_node_class.create(**dht_options)` over a daemon of its own started by `create_p2p(daemon_flags,
    **p2p_options)` (in a session of its own: a terminal's Ctrl-C reaches the node, which stops the daemon once it has
    saved) and handed to it (`hand_daemon_to`), so that it shuts the daemon down with itself."""
    p2p = await create_p2p(daemon_flags, initial_peers=dht_options.get("initial_peers"), **p2p_options)
    try:
        node = await dht_node_class.create(p2p=p2p, **dht_options)
    except BaseException:
        await p2p.shutdown()
        raise
    hand_daemon_to(node)  # hivemind leaves a daemon it was handed running; this one is the node's
    return node


def daemon_process(p2p: P2P) -> asyncio.subprocess.Process | None:
    """The p2pd process `p2p` started (its pid, command line, exit status); None for a daemon it only attached to.

    Why private (`P2P._child`): hivemind exposes neither the process nor its pid, and a daemon that stopped
    answering must still be killed when its node's shutdown hangs (`joining.shutdown_dht`); tests read a daemon's
    command line through it."""
    return p2p._child


def retire_control_connection(p2p: P2P) -> None:
    """Stop the tasks of `p2p`'s persistent control connection to its daemon, and take what they ended with.

    Why private (`P2P._client.control._read_task`, `_write_task`): when the daemon dies, the writing task fails on
    the next message it sends (ConnectionResetError) and nothing in hivemind awaits it, so asyncio prints a "Task
    exception was never retrieved" traceback when the task is collected, at the node's stop at the latest. The node
    has said that its daemon died (and rejoined over a new one): this is the old connection's end, not news."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    for task in (getattr(control, "_read_task", None), getattr(control, "_write_task", None)):
        if task is not None:
            task.add_done_callback(_take_outcome)
            task.cancel()


def _take_outcome(task) -> None:
    if not task.cancelled():
        task.exception()


def stream_listener_path(p2p: P2P) -> str:
    """The unix socket this process listens on for the streams `p2p`'s daemon brings in: the daemon connects to it
    once per incoming stream (tests connect and hang up as a dying daemon does).

    Why private (`P2P._client_listen_maddr`): hivemind keeps where its handlers listen to itself."""
    return p2p._client_listen_maddr.value_for_protocol("unix")


_serve_incoming_stream = ControlClient._handler


async def _serve_incoming_stream_to_its_end(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await _serve_incoming_stream(self, reader, writer)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        log.debug("an incoming stream ended early (its daemon or caller went away): %s: %s", type(exc).__name__, exc)
        writer.close()


# Why private (`ControlClient._handler`): the daemon connects to our listening socket once per incoming stream and
# sends the stream's header first; hivemind reads it outside any try, so a daemon killed (or a caller gone) before the
# header is whole ends the callback with IncompleteReadError, which asyncio logs as an ERROR with its traceback
# ("Unhandled exception in client_connected_cb"). The stream is gone with the daemon, whose death the node's session
# watch reports and rejoins after (`session.watch_joined`): this is the old stream's end, not news.
ControlClient._handler = _serve_incoming_stream_to_its_end
