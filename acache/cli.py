"""The `acache` command: up, mount, umount, down, flush, status.

Every failure is one clear line on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from acache import config
from acache.errors import AcacheError, ConfigError
from acache.node.client import Client, is_running

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="acache: a write-back cache for training checkpoints.")
out = Console()
err = Console(stderr=True)

HomeOpt = typer.Option(None, "--home", help="State directory (socket, log); env ACACHE_HOME.")
ConfigOpt = typer.Option(None, "--config", "-c", help="TOML config file.")


def _settings(home=None, config_file=None, **flags) -> config.Settings:
    return config.load(config_file, home=home, **flags)


_human = config.human_size


# -- up / down ----------------------------------------------------------------------------
def _run_foreground(s: config.Settings) -> None:
    from acache.node.daemon import Node
    from acache.node.server import ControlServer
    logging.basicConfig(level=s.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if is_running(s.socket_path):
        raise AcacheError(f"an acache node is already running (socket {s.socket_path})")
    config.check_layout(s)
    config.check_devices(s)
    for warning in config.startup_warnings(s):
        logging.getLogger("acache").warning("%s", warning)
    try:
        node = Node(s)
    except AcacheError:
        raise
    except Exception as e:   # a bug or a state the start does not handle: one line, and
        # the traceback in the log (the node's stderr is the log when it runs in the background)
        logging.getLogger("acache").exception("starting the node failed")
        raise AcacheError(f"starting the node failed: internal error ({type(e).__name__}: {e}) "
                          f"with the state in {s.cache_path}; please report it with the "
                          f"traceback in {s.log_path}") from None
    try:
        node.serve_metrics()
        server = ControlServer(node, str(s.socket_path))
    except BaseException:
        node.shutdown(flush=False)
        raise

    def on_signal(signum, frame):
        logging.getLogger("acache").info("signal %d: stopping (dirty data stays in the cache "
                                         "and is persisted at the next start)", signum)
        def stop():
            try:
                node.shutdown(flush=False)
            except Exception as e:
                logging.getLogger("acache").error("stopping: %s", e)
            finally:
                server.stop()
        threading.Thread(target=stop, daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"acache node ready (pid {os.getpid()}, socket {s.socket_path}"
          + (f", metrics http://{s.metrics}/metrics" if s.metrics else "") + ")",
          file=sys.stderr, flush=True)
    # systemd (Type=notify): the control socket listens now, so a client that connects from
    # here on is served; serve() only starts the loop that accepts it
    from acache.node.notify import notify
    notify(f"STATUS=serving on {s.socket_path}")
    notify("READY=1")
    server.serve()


def _start_background(s: config.Settings, argv: list[str]) -> None:
    if is_running(s.socket_path):
        return
    config.check_layout(s)        # the node checks again; this fails before starting one
    config.check_devices(s)
    for warning in config.startup_warnings(s):
        err.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    s.home.mkdir(parents=True, exist_ok=True)
    # 0600: the log names files of private directories
    log = os.fdopen(os.open(s.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
    os.fchmod(log.fileno(), 0o600)
    start = log.tell()
    env = dict(os.environ, ACACHE_HOME=str(s.home))
    proc = subprocess.Popen([sys.executable, "-m", "acache.cli", "up", "--foreground", *argv],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                            start_new_session=True, close_fds=True)
    # a cluster member may wait for etcd up to stall_timeout before it can say it is ready
    wait = 60.0 + (s.stall_timeout if s.meta else 0.0)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(s.log_path, "rb") as f:
                f.seek(start)
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
            said = [ln for ln in lines if ln.startswith("acache: error: ")]
            if said:        # the node's own one-line error
                raise AcacheError(said[-1].removeprefix("acache: error: "))
            # died some other way (a traceback, a signal): say so, and where to look
            raise AcacheError(f"the node exited with status {proc.returncode} while starting"
                              + (f" ({lines[-1].strip()})" if lines else "")
                              + f"; see {s.log_path}")
        if is_running(s.socket_path):
            return
        time.sleep(0.1)
    raise AcacheError(f"the node did not become ready within {wait:.0f} s; see {s.log_path}")


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
        raise ConfigError(f"--timeout {timeout:g}: expected a finite number of seconds >= 0")


NoCacheOpt = typer.Option(False, "--no-cache",
                          help="This node has no cache: the files it writes are placed on the "
                          "cluster's workers (placement = hash; needs meta).")


def _up_argv(cache_dir, ufs, config_file, cache_size, engine, metrics=None,
             upload_limit=None, no_cache=False, meta=None) -> list[str]:
    argv = ["--no-cache"] if no_cache else []
    for flag, value in (("--cache-dir", cache_dir), ("--ufs", ufs), ("--config", config_file),
                        ("--cache-size", cache_size), ("--engine", engine),
                        ("--metrics", metrics), ("--upload-limit", upload_limit),
                        ("--meta", meta)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


@app.command()
def up(cache_dir: Optional[Path] = typer.Option(None, help="Cache directory (local NVMe)."),
       ufs: Optional[str] = typer.Option(None, help="Under-storage URL: file:///dir or s3://bucket/prefix."),
       config_file: Optional[Path] = ConfigOpt,
       cache_size: Optional[str] = typer.Option(None, help="Cache limit, e.g. 50GiB (default: half the disk)."),
       engine: Optional[str] = typer.Option(None, help="Mount engine: auto, native, pyfuse3."),
       metrics: Optional[str] = typer.Option(None, help="Serve Prometheus metrics at HOST:PORT/metrics "
                                             "(e.g. 127.0.0.1:9567; off by default)."),
       upload_limit: Optional[str] = typer.Option(None, "--upload-limit",
                                                  help="Cap on upload bandwidth: 200MiB/s, off, or a "
                                                  "timetable \"08:00,100MiB/s 20:00,off\"."),
       foreground: bool = typer.Option(False, "--foreground",
                                       help="Stay attached, log to stderr (systemd: Type=notify)."),
       no_cache: bool = NoCacheOpt,
       meta: Optional[str] = typer.Option(None, "--meta",
                                          help="Join cluster NAME: etcd://HOST:PORT[,...]/NAME "
                                          "(needs listen; default: single-host)."),
       home: Optional[Path] = HomeOpt) -> None:
    """Start the node daemon (in the background unless --foreground)."""
    s = _settings(home, config_file, cache_dir=cache_dir, ufs=ufs, cache_size=cache_size, engine=engine,
                  metrics=metrics, upload_limit=upload_limit, placement="hash" if no_cache else None,
                  meta=meta)
    if foreground:
        _run_foreground(s)
        return
    if is_running(s.socket_path):
        out.print(f"acache node already running ({s.socket_path})")
        return
    _start_background(s, _up_argv(cache_dir, ufs, config_file, cache_size, engine, metrics, upload_limit,
                                  no_cache, meta))
    out.print(f"acache node up: cache {s.cache_path}, under-storage {s.ufs_url}, log {s.log_path}"
              + (f", metrics http://{s.metrics}/metrics" if s.metrics else ""))


@app.command()
def down(no_flush: bool = typer.Option(False, "--no-flush", help="Stop without persisting dirty data."),
         timeout: Optional[float] = typer.Option(None, help="Give up flushing after this many seconds."),
         home: Optional[Path] = HomeOpt) -> None:
    """Stop the node, by default after persisting everything dirty."""
    _check_timeout(timeout)
    s = _settings(home)
    with Client(s.socket_path, timeout=None) as c:
        res = c.call("down", flush=not no_flush, timeout=timeout)
    deadline = time.monotonic() + 30    # gone, so that an `acache up` right after starts anew
    while is_running(s.socket_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    if no_flush and res.get("left_dirty"):
        err.print(f"[yellow]warning:[/] {res['left_dirty']} journal entries stay dirty in "
                  f"{res.get('cache_dir') or s.cache_path}; they are persisted at the next "
                  "`acache up`", soft_wrap=True)
    out.print("acache node stopped")


# -- mount ----------------------------------------------------------------------------------
@app.command()
def mount(path: Path = typer.Argument(..., help="Where to mount (an empty directory)."),
          engine: Optional[str] = typer.Option(None, help="auto, native or pyfuse3."),
          cache_dir: Optional[Path] = typer.Option(None, help="For a node started here."),
          ufs: Optional[str] = typer.Option(None, help="For a node started here."),
          config_file: Optional[Path] = ConfigOpt,
          no_cache: bool = NoCacheOpt,
          home: Optional[Path] = HomeOpt) -> None:
    """Attach the FUSE mount to the running node (starting one if none runs)."""
    s = _settings(home, config_file, cache_dir=cache_dir, ufs=ufs, engine=engine,
                  placement="hash" if no_cache else None)
    _start_background(s, _up_argv(cache_dir, ufs, config_file, None, engine, no_cache=no_cache))
    with Client(s.socket_path, timeout=120) as c:
        res = c.call("mount", path=str(path.absolute()), engine=engine or "",
                     placement="hash" if no_cache else "")
    pt = ", kernel passthrough" if res.get("passthrough") else ""
    out.print(f"mounted {res['mountpoint']} ({res['engine']} engine{pt}: {res.get('why') or 'chosen'})",
              soft_wrap=True)


@app.command()
def umount(path: Path = typer.Argument(...), home: Optional[Path] = HomeOpt) -> None:
    """Detach the mount (the node keeps persisting)."""
    s = _settings(home)
    with Client(s.socket_path) as c:
        c.call("umount", path=str(path.absolute()))
    out.print(f"unmounted {path}")


# -- flush ----------------------------------------------------------------------------------
@app.command()
def flush(path: Optional[Path] = typer.Argument(None, help="Only what is under this path."),
          wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the barrier."),
          timeout: Optional[float] = typer.Option(None, help="Fail after this many seconds."),
          home: Optional[Path] = HomeOpt) -> None:
    """Persist now; with --wait, return 0 only when everything written before is persisted."""
    _check_timeout(timeout)
    s = _settings(home)
    p = str(path.absolute()) if path else None
    with Client(s.socket_path, timeout=30) as c:
        if not wait:
            c.call("status")   # the node persists on its own; --no-wait only checks it is up
            out.print("the node is persisting in the background")
            return
        # a log or a pipe: a plain line a second on stdout (stderr keeps only a failure's one
        # line), no control codes
        plain = not err.is_terminal
        with Progress(TextColumn("[bold]persisting"), BarColumn(), DownloadColumn(),
                      TextColumn("{task.fields[files]} files"), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err, disable=plain, transient=True) as prog:
            task = prog.add_task("flush", total=None, files=0)
            last = [time.monotonic()]

            def on_progress(info: dict) -> None:
                total = max(info["total_bytes"], 1)
                files = info["files_left"] + info["open_files"]
                if not plain:
                    prog.update(task, total=total, completed=total - info["bytes_left"], files=files)
                elif time.monotonic() - last[0] >= 1.0:
                    last[0] = time.monotonic()
                    done = max(0, info["total_bytes"] - info["bytes_left"])
                    print(f"{time.strftime('%H:%M:%S')} persisting: {_human(done)} of "
                          f"{_human(info['total_bytes'])} done, {files} files left, "
                          f"{_human(info['rate'])}/s", flush=True)
            res = c.flush(p, timeout, on_progress)
    out.print(f"flushed in {res['seconds']:.2f}s: everything written before is in the under-storage")
    if res.get("unacknowledged"):
        err.print(f"[yellow]warning:[/] {res['unacknowledged']} files were open for writing at a "
                  "crash and never fsynced: kept in the cache, not persisted until closed again "
                  "(`acache status PATH`)")
    if res.get("lost_found"):
        err.print(f"[yellow]warning:[/] {res['lost_found']} cache files the metadata did not know "
                  "are kept in lost+found (see `acache status`)")


# -- status ---------------------------------------------------------------------------------
@app.command()
def status(path: Optional[Path] = typer.Argument(None, help="Show each file's state under PATH."),
           as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
           watch: bool = typer.Option(False, "--watch", "-w",
                                      help="Redraw every second until Ctrl-C (exit 0); not a "
                                      "terminal: one plain line a second."),
           interval: float = typer.Option(1.0, help="Seconds between redraws with --watch."),
           home: Optional[Path] = HomeOpt) -> None:
    """The node (cache, dirty data, persist queue, errors), or each file's state under PATH."""
    s = _settings(home)
    if watch:
        if as_json or path is not None:
            raise ConfigError("--watch shows the node: no PATH or --json with it")
        if not math.isfinite(interval) or not 0.1 <= interval <= 3600:
            raise ConfigError(f"--interval {interval:g}: expected seconds from 0.1 to 3600")
        from acache.watch import watch_status
        watch_status(s.socket_path, interval, out, node_table)
        return
    with Client(s.socket_path) as c:
        st = c.call("status", path=str(path.absolute()) if path else None)
    if as_json:
        out.print_json(json.dumps(st))
        return
    out.print(node_table(st))
    if path is not None:
        ft = Table(title=f"files under {path}")
        ft.add_column("path")
        ft.add_column("state")
        ft.add_column("size", justify="right")
        colors = {"dirty": "yellow", "persisting": "cyan", "persisted": "green", "failed": "red",
                  "unacknowledged": "red"}
        for f in st.get("files", []):
            state = f"[{colors.get(f['state'], 'red')}]{f['state']}[/]"
            if f.get("note"):
                state += f" ({f['note']})"
            ft.add_row(f["path"], state, _human(f["size"]))
        out.print(ft)


def node_table(st: dict) -> Table:
    t = Table(title="acache node", show_header=False)
    t.add_row("mount", f"{st['mountpoint'] or '-'} ({st['engine'] or 'no engine'}"
              f"{', passthrough' if st['passthrough'] else ''})")
    t.add_row("under-storage", st["ufs"])
    room = st.get("cache_limit_now", st["cache_limit"])
    t.add_row("cache", f"{_human(st['cache_used'])} of {_human(st['cache_limit'])} in {st['cache_dir']}"
              + (f" (room for {_human(room)}: its filesystem's free space less the metadata "
                 "reserve)" if room < st["cache_limit"] else ""))
    if st.get("meta_reserve_held") is False:
        t.add_row("metadata reserve", "[yellow]in use: the cache filesystem was full[/]")
    t.add_row("dirty", f"{_human(st['dirty_bytes'])} in {st['dirty_files']} files")
    t.add_row("persist queue", f"{st['queue']} entries, {_human(st['queue_bytes'])}, {st['in_flight']} in flight")
    w = st.get("waits_for_writer")
    if w and w.get("behind"):
        t.add_row("persisting waits", f"[yellow]for {w['path']}'s writer to close it[/] (reopened and "
                  f"written in place before its upload started; the {w['behind']} entries after it "
                  "land once it is closed)")
    t.add_row("rate", f"{_human(st['rate'])}/s; persisted {st['persisted_files']} files, "
              f"{_human(st['persisted_bytes'])} since start")
    setting = st.get("upload_limit_setting", "off")
    t.add_row("upload limit", st.get("upload_limit", "off")
              + (f" (timetable {setting})" if " " in setting.strip() else ""))
    if st.get("metrics"):
        t.add_row("metrics", f"http://{st['metrics']}/metrics")
    t.add_row("last error", f"[red]{st['last_error']}[/]" if st["last_error"] else "-")
    for f in st.get("failed_entries", []):
        what = f"{f['path']} -> {f['dst']}" if f["dst"] else f["path"]
        t.add_row(f"failed #{f['seq']}", f"[red]{f['op']} {what}: {f['error']}[/] "
                  "(`acache journal`; `acache journal skip SEQ --reason ...` if it can never succeed)")
    cl = st.get("cluster")
    if cl:
        t.add_row("cluster", f"node {cl['node']} at {cl['address']}, head {cl.get('head') or '-'} "
                  f"({cl['meta']})" + (f" [red]{cl['error']}[/]" if cl.get("error") else ""))
        if cl.get("blocked_by"):
            o = cl.get("oldest") or {}
            t.add_row("persisting blocked", f"[red]by node {cl['blocked_by']}[/] (it holds "
                      f"{o.get('path', '?')}, the oldest entry; {cl.get('blocked_files', '?')} "
                      f"files, {_human(cl.get('blocked_bytes', 0))} wait for it"
                      + (f", since {time.strftime('%H:%M:%S', time.localtime(cl['blocked_since']))}"
                         if cl.get("blocked_since") else "") + ")")
        for n in cl.get("nodes", []):
            state = "[green]alive[/]" if n["alive"] else "[red]down[/]"
            held = n.get("held_files")
            t.add_row(f"  {n['id']}", f"{n['address']} {state}"
                      + (" head" if n.get("head") else "")
                      + (f", {held} files / {_human(n.get('held_bytes', 0))} unpersisted"
                         if held else "")
                      + (f", writing {n['placed_open']} files of cacheless clients"
                         if n.get("placed_open") else "") + f", transport {n['transport']}")
    if st.get("lost_found_files"):
        t.add_row("lost+found", f"[red]{st['lost_found_files']} files, "
                  f"{_human(st['lost_found_bytes'])} in {st['lost_found_dir']}[/] (cache files "
                  "the metadata did not know at start: data of files the mount does not show)")
    return t


# -- mount(8) helper --------------------------------------------------------------------------
@app.command("install-helper")
def install_helper(directory: Path = typer.Option(Path("/sbin"), "--dir",
                                                  help="Where mount(8) looks for helpers.")) -> None:
    """Install mount.fuse.acache, so that /etc/fstab can hold `acache /ckpt fuse.acache ...`."""
    from acache.mount_helper import script_text
    if not directory.is_dir():
        raise ConfigError(f"--dir {directory}: not a directory")
    target = directory / "mount.fuse.acache"
    tmp = directory / ".mount.fuse.acache.tmp"
    tmp.write_text(script_text())
    tmp.chmod(0o755)
    os.replace(tmp, target)
    out.print(f"installed {target} (fstab: acache /ckpt fuse.acache defaults,_netdev 0 0)")


# -- journal --------------------------------------------------------------------------------
journal_app = typer.Typer(add_completion=False, invoke_without_command=True,
                          help="The persist queue: list pending entries, skip one that can never succeed.")
app.add_typer(journal_app, name="journal")


@journal_app.callback()
def journal(ctx: typer.Context,
            limit: int = typer.Option(100, help="Show at most this many (the oldest first)."),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
            home: Optional[Path] = HomeOpt) -> None:
    """List the pending journal entries, oldest first: seq, op, path, state, error."""
    if ctx.invoked_subcommand is not None:
        return
    s = _settings(home)
    with Client(s.socket_path) as c:
        res = c.call("journal", limit=limit)
    if as_json:
        out.print_json(json.dumps(res))
        return
    t = Table(title=f"journal: {res['total']} entries pending"
              + (f" (the oldest {len(res['entries'])} shown)" if res["total"] > len(res["entries"]) else ""))
    for col in ("seq", "op", "path", "state", "error"):
        t.add_column(col, justify="right" if col == "seq" else "left", overflow="fold")
    for e in res["entries"]:
        path = f"{e['path']} -> {e['dst']}" if e["dst"] else e["path"]
        state = f"[red]{e['state']}[/]" if e["state"] == "failed" else e["state"]
        t.add_row(str(e["seq"]), e["op"], path, state, e["error"] or "")
    out.print(t)


@journal_app.command("skip")
def journal_skip(seq: int = typer.Argument(..., help="The entry's seq (see `acache journal`)."),
                 reason: str = typer.Option(..., "--reason", help="Why it can never succeed (logged)."),
                 home: Optional[Path] = HomeOpt) -> None:
    """Drop one entry that can never succeed; everything after it keeps its order."""
    s = _settings(home)
    with Client(s.socket_path) as c:
        res = c.call("journal_skip", seq=seq, reason=reason)
    what = f"{res['path']} -> {res['dst']}" if res["dst"] else res["path"]
    out.print(f"skipped journal entry {res['seq']}: {res['op']} {what}")


def main() -> None:
    try:
        app(standalone_mode=False)
    except (AcacheError, OSError) as e:
        msg = str(e) if isinstance(e, AcacheError) else f"{e.strerror or e}: {e.filename or ''}".strip(": ")
        print(f"acache: error: {msg}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err.print("acache: interrupted")
        sys.exit(130)
    except Exception as e:   # click usage errors and the like
        import click
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            # typer's own copy of click: a usage error, as one line with the option's name
            if e.format_message():    # (no arguments at all: the help was shown)
                print(f"acache: error: {e.format_message()}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        print(f"acache: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
