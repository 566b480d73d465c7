"""The namespace wire schema (acache.cluster.schema): one table, checked requests."""
from __future__ import annotations

import errno

import pytest

from acache.cluster import schema
from acache.cluster.member import _Head
from acache.errors import FsError


def test_every_op_in_the_table_has_a_handler_and_every_handler_an_op():
    handlers = {n[3:] for n in dir(_Head) if n.startswith("op_")}
    assert handlers == set(schema.OPS)
    assert schema.served() == sorted(schema.OPS)


def test_a_request_round_trips_through_the_wire_form():
    req = schema.request("rename", parent_old=1, name_old=b"a", parent_new=2, name_new=b"b", flags=1)
    op, args = schema.encode(req)
    assert op == "rename" and args["name_new"] == b"b"
    assert schema.decode(op, args) == req
    assert schema.decode("sync", None) == schema.Sync()
    assert schema.decode("flush", {"path": "d", "timeout": 3}).timeout == 3
    assert schema.decode("status", {}).path is None


@pytest.mark.parametrize("op,args,why", [
    ("lookup", {"parent": 1}, "missing argument 'name'"),
    ("lookup", {"parent": 1, "name": "x"}, "'name' is str"),
    ("lookup", {"parent": True, "name": b"x"}, "'parent' is bool"),
    ("lookup", {"parent": 1, "name": b"x", "evil": 1}, "unknown argument 'evil'"),
    ("open_write", {"ino": 5, "trunc": 1}, "'trunc' is int"),
    ("mkdir", {"parent": 1, "name": b"d", "mode": 0o755, "ctx": {"root": 1}}, "ctx key 'root'"),
    ("rejoin", {"files": [[1, 2]]}, "files is not a list"),
    ("close", [1, 2, 3], "not a map"),
])
def test_bad_arguments_are_einval_with_the_reason(op, args, why):
    with pytest.raises(FsError) as e:
        schema.decode(op, args)
    assert e.value.errno == errno.EINVAL
    assert why in str(e.value)


def test_an_op_this_acache_does_not_serve_is_enosys():
    for op in ("format_disk", None, 7):
        with pytest.raises(FsError) as e:
            schema.decode(op, {})
        assert e.value.errno == errno.ENOSYS


def test_the_asking_side_catches_its_own_bugs_before_sending():
    with pytest.raises(TypeError):
        schema.request("lookup", parent=1)
    with pytest.raises(TypeError):
        schema.request("lookup", parent=1, name="not bytes")
    with pytest.raises(TypeError):
        schema.request("no_such_op")
