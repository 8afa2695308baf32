"""Work that reads every trial of a storage (a rebuild of trials.csv, the progress view's
snapshot) is paced by its own cost (``progress.Pacer``), so that it keeps to a small share of a
sweep on a large storage. A fake clock stands in for time.monotonic."""
from splitkv_tune import progress, sweep


def test_a_rebuild_waits_longer_after_a_slow_one(monkeypatch):
    """On a large storage a rebuild takes seconds: the next waits that many times over, so the
    files' upkeep stays a small share of the sweep."""
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    done = []

    def rebuild(seconds):
        done.append(clock[0])
        clock[0] += seconds

    took = [0.5]
    pacer = progress.Pacer(lambda: rebuild(took[0]), sweep.REBUILD_EVERY_S, sweep.REBUILD_TIME_FACTOR)
    for now in (110.0, 129.0, 130.0, 159.0, 160.5):
        clock[0] = now
        pacer()
    assert done == [130.0, 160.5]  # every 30 s while a rebuild takes 0.5 s
    took[0] = 3.0                   # 20 x 3 s: the next is due 60 s after this one ends
    clock[0] = 200.0
    pacer()
    for now in (250.0, 262.9, 263.0):
        clock[0] = now
        pacer()
    assert done == [130.0, 160.5, 200.0, 263.0]


def test_the_progress_view_waits_longer_after_a_slow_snapshot(monkeypatch):
    """A snapshot reads every trial: on a large storage the view spaces them by their cost."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    cost = [0.1]

    def slow_snapshot(storage, plan):
        clock[0] += cost[0]
        return {"per_worker": {}, "done": 0, "planned": 1}

    monkeypatch.setattr(progress, "snapshot", slow_snapshot)
    lines = []
    view = progress.ProgressView(None, None, lines.append)
    for now in (1000.0, 1004.0, 1005.1, 1010.2):  # every 5 s after the last ends, at 0.1 s a snapshot
        clock[0] = now
        view()
    assert len(lines) == 3
    cost[0] = 2.0                                 # 10 x 2 s: the next is due 20 s after this one
    clock[0] = 1020.0
    view()
    for now, printed in ((1030.0, 4), (1041.9, 4), (1042.0, 5)):
        clock[0] = now
        view()
        assert len(lines) == printed
