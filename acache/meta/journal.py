"""How namespace changes become journal entries (DESIGN.md points 4 and 5).

The under-storage must always show a prefix of the history, with the names of
data that was never persisted elided:
  * closing a file appends PUT(path, ino, gen); an older PUT of the same file
    that has not started is superseded (cancelled) when nothing was journaled
    after it (else it stays: what was closed after it must not land before it);
  * renaming data that is not in the under-storage yet moves its pending PUT
    (and MKDIRs, for a directory) to the rename's place in the journal, under
    the new name: no traffic for the old name, and nothing closed after the
    rename can land before it.  If any of it is already in the under-storage
    (or being committed), a RENAME entry is appended instead, applied in order;
    so is a directory with pending entries when the under-storage renames
    directories atomically: moving its entries one by one would show the new
    name half-populated, a state that never existed (the staging pattern
    tmp-checkpoint-N -> checkpoint-N relies on the name appearing whole);
  * deleting cancels pending PUTs/MKDIRs; a DELETE/RMDIR is appended only when
    something may exist in the under-storage.  Nothing deleted comes back.
  * a symbolic link is a SYMLINK entry, journaled at creation and treated like
    a PUT by renames and deletes (moved or cancelled while it has not landed);
  * PUTs may commit out of seq order where their closes overlapped in time
    (Entry.after, MetaStore.op); every other entry, and a PUT of a path or inode
    an earlier pending entry has, waits for all before it (data/persister.py);
  * changing only attributes (chmod, chown, utime) appends an ATTRS entry, unless
    an entry of the same inode that has not started yet will carry them (entries
    take the inode's attributes when they start): no re-upload, ever.

All functions run under the MetaStore lock, inside one Txn.
"""
from __future__ import annotations

from typing import Protocol

from acache.meta.store import ROOT_INO, Entry, Inode, MetaStore, Txn


class Inflight(Protocol):
    """What the persister tells the journal rules about entries it works on."""

    def state(self, seq: int) -> str:
        """'' (not started) | 'staging' (uploading, abortable) | 'committing'."""

    def abort(self, seq: int) -> None:
        """Stop staging this entry; its upload is thrown away."""


def _cancel(txn: Txn, inflight: Inflight, e: Entry) -> None:
    if inflight.state(e.seq) == "staging":
        inflight.abort(e.seq)
    txn.remove_entry(e.seq)
    if e.op == "put":
        txn.freed.append((e.ino, e.gen))


def journal_put(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode) -> Entry:
    """The file was closed: commit its current generation at its current path."""
    for e in meta.puts_of(node.ino):
        if e.hold and e.gen == node.gen:     # reopened in place: its PUT keeps its place
            e.hold, e.size, e.path = False, node.size, meta.path_of(node.ino)
            e.after = e.seq - 1       # what it commits now was written after all before it
            txn.update_entry(e)
            return e
    replaces = False
    superseded = []
    for old in meta.newest():
        if old.ino != node.ino or old.op != "put" or inflight.state(old.seq) != "":
            break    # anything journaled after an older PUT must not land before its content
        superseded.append(old)
    for old in superseded:
        replaces = replaces or old.replaces
        _cancel(txn, inflight, old)
    e = txn.append(op="put", path=meta.path_of(node.ino), ino=node.ino, gen=node.gen,
                   size=node.size, replaces=replaces)
    for old in superseded:       # its content includes theirs: a barrier waits for it
        txn.succeeds(old.seq, e)
    return e


def hold_put(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode) -> bool:
    """A closed file whose PUT has not started is opened for writing again, and copying
    it would be costly: write it in place; its PUT keeps its place in the journal but
    waits for the next close and then commits what the file holds by then.  Nothing
    journaled after it can land before it, so ordering holds; the under-storage just
    gets the file's newer content.  False if a PUT of it is being committed."""
    mine = [e for e in meta.puts_of(node.ino) if e.gen == node.gen]
    if any(inflight.state(e.seq) == "committing" for e in mine):
        return False
    for e in mine:
        if inflight.state(e.seq) == "staging":
            inflight.abort(e.seq)       # its bytes are about to change
        e.hold = True
        txn.update_entry(e)
    return True


def on_reopen(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode) -> None:
    """Writers still hold ``node``'s journaled generation open: close(2) sends FLUSH
    for every descriptor, so a fork+exec or a dup'd fd "closes" a file its owner goes
    on writing.  Its pending PUTs are not its final content: cancel those not yet
    committing (a commit has its bytes already); the next close journals it again,
    and ``node.dirty`` re-journals it after a crash before that."""
    replaces = False
    for e in meta.puts_of(node.ino):
        if e.gen == node.gen and inflight.state(e.seq) != "committing":
            replaces = replaces or e.replaces
            _cancel(txn, inflight, e)
    if replaces and node.upath is None:   # the replaced file's object goes where it went
        txn.append(op="delete", path=meta.path_of(node.ino), ino=node.ino)


def _subtree(meta: MetaStore, node: Inode) -> list[Inode]:
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        if n.is_dir:
            todo.extend(meta.get(i) for i in meta.children(n.ino).values())
    return out


def on_delete(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode, path: str,
              append: bool = True) -> bool:
    """``node`` (a file, or an empty directory) is going away from ``path``.
    Returns whether the under-storage may hold it (then a DELETE/RMDIR is
    appended, unless ``append`` is False and the caller takes care of it)."""
    committing = replaces = used = False
    if node.is_dir:   # pending entries of other things under one of its names need it there
        # (a scan of the journal, but only for directories: rmtree's files cost O(1) each)
        names = [path] + [e.path for e in meta.entries_of(node.ino, "rename")]
        used = any(p.startswith(n + "/") for e in meta.journal() if e.ino != node.ino
                   for p in (e.path, e.dst) if p for n in names)
    for e in meta.entries_of(node.ino, "put", "mkdir", "symlink", "attrs"):
        if inflight.state(e.seq) == "committing":
            committing = True
        elif e.op == "mkdir" and used:
            pass        # it lands, serves those entries, and goes (RMDIR below)
        else:
            replaces = replaces or e.replaces
            _cancel(txn, inflight, e)
    # replaces: the object of a file this one replaced by rename is still there
    remote = node.upath is not None or committing or replaces or used
    if not remote:   # a directory renamed before anything of it landed: nothing to move
        for e in meta.entries_of(node.ino, "rename"):
            if inflight.state(e.seq) != "committing":
                txn.remove_entry(e.seq)
    if remote and append:
        txn.append(op="rmdir" if node.is_dir else "delete", path=path, ino=node.ino)
    return remote


def on_rename(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode,
              old: str, new: str, atomic_dirs: bool = False, replaces_remote: bool = False) -> bool:
    """``node`` moves from ``old`` to ``new``.  Returns True when an entry now
    lands at ``new`` (so a replaced target needs no DELETE of its own).
    ``atomic_dirs``: the under-storage renames a directory in one step.
    ``replaces_remote``: the rename replaces a target the under-storage holds; an
    entry landing at ``new`` is marked so that cancelling it deletes that object."""
    sub = _subtree(meta, node)
    inos = {n.ino for n in sub}
    mine = sorted((e for i in inos for e in meta.entries_of(i, "put", "mkdir", "symlink", "attrs")),
                  key=lambda e: e.seq)
    remote = any(n.upath is not None for n in sub) \
        or any(inflight.state(e.seq) == "committing" for e in mine) \
        or any(meta.entries_of(i, "rename") for i in inos) \
        or (atomic_dirs and node.is_dir and bool(mine))
    if remote:
        txn.append(op="rename", path=old, dst=new, ino=node.ino, inos=sorted(inos))
        return True
    moved = False
    # objects of replaced targets that moved entries were to land on stay at the old
    # names: remove them there (deepest first) before anything lands at the new ones
    for e in sorted((e for e in mine if e.replaces), key=lambda e: -meta.path_of(e.ino).count("/")):
        txn.append(op="rmdir" if e.op == "mkdir" else "delete", path=meta.path_of(e.ino), ino=e.ino)
    for e in mine:
        _cancel(txn, inflight, e)
        if e.op == "attrs":
            continue     # the entry moved with it takes the attributes when it starts
        path = new + meta.path_of(e.ino)[len(old):]   # e.path may predate an ancestor's rename
        lands = path == new
        n = txn.append(op=e.op, path=path, ino=e.ino, gen=e.gen, size=e.size,
                       replaces=lands and replaces_remote, hold=e.hold, target=e.target,
                       node=e.node)     # (a cluster: the bytes are still where they were)
        txn.succeeds(e.seq, n)       # the same bytes, under the new name
        moved = moved or lands
    return moved


def on_attrs(meta: MetaStore, txn: Txn, inflight: Inflight, node: Inode) -> Entry | None:
    """Only the attributes of ``node`` changed (mode, owner, mtime)."""
    if node.ino == ROOT_INO or node.dirty:     # the root is the operator's; a file being
        return None                               # written lands with them at its close
    own = meta.entries_of(node.ino, "put", "mkdir", "symlink", "attrs")
    if any(inflight.state(e.seq) == "" for e in own):
        return None      # it has not started: it takes the attributes when it does
    if node.upath is None and not own:
        return None      # nothing of it is (or is about to be) in the under-storage
    return txn.append(op="attrs", path=meta.path_of(node.ino), ino=node.ino)
