"""acache.data.limit: parsing, the timetable (wrapping around midnight), the token bucket."""
from __future__ import annotations

import time

import pytest

from acache.data.limit import LimitError, TokenBucket, describe, parse

MiB = 1 << 20


def at(hh: int, mm: int) -> float:
    lt = time.localtime()
    return time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, hh, mm, 0, 0, 0, -1))


def test_constant_and_off():
    assert parse("200MiB/s").rate_at() == 200 * MiB
    assert parse("1.5GiB/s").rate_at() == 1.5 * 1024 * MiB
    assert parse(1000).rate_at() == 1000
    assert parse("off").rate_at() is None and parse("off").off


def test_timetable_last_passed_entry_wrapping_midnight():
    s = parse("08:00,100MiB/s 12:30,10MiB/s 20:00,off")
    assert s.rate_at(at(8, 0)) == 100 * MiB
    assert s.rate_at(at(12, 29)) == 100 * MiB
    assert s.rate_at(at(12, 30)) == 10 * MiB
    assert s.rate_at(at(23, 59)) is None
    assert s.rate_at(at(3, 0)) is None          # before 08:00: yesterday's last entry
    assert parse("06:00,off 22:00,1MiB/s").rate_at(at(1, 0)) == MiB


@pytest.mark.parametrize("bad", ["", "fast", "0", "-1MiB/s", "08:00", "8h,1MiB/s", "24:00,off",
                                 "08:60,off", "10:00,off 09:00,1MiB/s", "10:00,off 10:00,off",
                                 "08:00,zero", True])
def test_bad_values(bad):
    with pytest.raises(LimitError):
        parse(bad)


def test_describe():
    assert describe(None) == "off"
    assert describe(200 * MiB) == "200 MiB/s"


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_bucket_holds_the_rate_with_one_burst():
    ft = FakeTime()
    b = TokenBucket(parse("10MiB/s"), clock=ft.clock, sleep=ft.sleep)
    start = ft.now
    for _ in range(100):                  # 100 pieces of 1 MiB
        b.take(MiB)
    took = ft.now - start
    # 100 MiB at 10 MiB/s, less the bucket's initial allowance (it starts empty here)
    assert 9.8 <= took <= 10.2, took
    assert b.taken == 100 * MiB and b.waited > 9


def test_bucket_refills_at_most_a_burst():
    ft = FakeTime()
    b = TokenBucket(parse("4MiB/s"), clock=ft.clock, sleep=ft.sleep)
    b.take(1)
    ft.now += 3600                        # idle for an hour: at most a burst (1 MiB) saved up
    t0 = ft.now
    b.take(5 * MiB)
    assert ft.now - t0 == pytest.approx(1.0, abs=0.01)   # (5 - 1) MiB at 4 MiB/s


def test_bucket_off_never_waits():
    ft = FakeTime()
    b = TokenBucket(parse("off"), clock=ft.clock, sleep=ft.sleep)
    for _ in range(10):
        b.take(1 << 30)
    assert ft.now == 1000.0 and b.taken == 10 << 30


@pytest.mark.parametrize("scheme", ["file", "mem"])
def test_stores_pay_for_every_byte_they_upload(tmp_path, scheme):
    """Each store calls the limiter before sending, for every byte of a stage."""
    from acache.data.under import open_store
    url = f"file://{tmp_path / 'ufs'}" if scheme == "file" else f"mem://limit-{tmp_path.name}"
    store = open_store(url)
    paid: list[int] = []
    store.set_limiter(paid.append)
    src = tmp_path / "src"
    size = 9 * MiB + 123
    src.write_bytes(b"x" * size)
    staged = store.stage("a/b", store.new_token("a/b"), str(src), size)
    staged.commit()
    assert sum(paid) == size and len(paid) >= 3, paid      # in pieces, not at once
    store.set_limiter(None)
    staged = store.stage("a/c", store.new_token("a/c"), str(src), size)
    staged.commit()
    assert sum(paid) == size
    store.close()
