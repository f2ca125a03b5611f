"""Unit tests of the resource-manager state machine: events in, exact actions out, no I/O."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest

from server.resource_manager import (
    Action,
    CreateSlice,
    DeleteSlice,
    Event,
    HostLost,
    HostUp,
    PhysicalDevice,
    PlacementPreview,
    RejectCode,
    Rejected,
    ReleaseOwner,
    RemapRecord,
    ResourceManager,
    Slice,
    SliceCreated,
    SliceDegraded,
    SliceDeleted,
    SliceRemapped,
    SliceRequest,
    SliceRestored,
    SliceStatus,
)


def devs(host: str, island: str, ids: range | list[int], kind: str = "cpu") -> tuple[PhysicalDevice, ...]:
    return tuple(PhysicalDevice(i, island, host, kind) for i in ids)


def cluster(
    *hosts: tuple[str, str, range | list[int]] | tuple[str, str, range | list[int], str],
) -> ResourceManager:
    """hosts: (host, island, device ids[, kind])."""
    rm = ResourceManager(debug=True)
    for spec in hosts:
        host, island, ids = spec[0], spec[1], spec[2]
        kind = spec[3] if len(spec) == 4 else "cpu"
        assert rm.handle(HostUp(host, devs(host, island, ids, kind))) == []
    return rm


def create(
    rm: ResourceManager, name: str, n: int, *, owner: str = "", dry_run: bool = False, **kw: Any
) -> Action:
    actions = rm.handle(CreateSlice(SliceRequest(name, n, **kw), owner=owner, dry_run=dry_run))
    assert len(actions) == 1
    return actions[0]


def placed(rm: ResourceManager, name: str, n: int, **kw: Any) -> tuple[int, ...]:
    action = create(rm, name, n, **kw)
    assert isinstance(action, SliceCreated), action
    return action.slice.mapping


def rejected(action: Action, code: RejectCode) -> str:
    assert isinstance(action, Rejected), action
    assert action.code == code, action
    return action.message


def loads(rm: ResourceManager) -> dict[int, int]:
    return {d: rm.device_load(d) for d in rm.devices}


# ------------------------------------------------------------------------------------------ placement


def test_shared_slices_spread_then_share_least_loaded() -> None:
    rm = cluster(("h1", "a", range(4)))
    assert placed(rm, "s1", 2) == (0, 1)
    assert placed(rm, "s2", 2) == (2, 3)
    assert placed(rm, "s3", 1) == (0,)
    assert placed(rm, "s4", 2) == (1, 2)
    assert loads(rm) == {0: 2, 1: 2, 2: 2, 3: 1}


def test_created_slice_fields_and_explanation() -> None:
    rm = cluster(("h1", "a", range(4)))
    action = create(rm, "train", 4, mesh=(2, 2), owner="client:7")
    assert isinstance(action, SliceCreated)
    s = action.slice
    assert s == Slice(
        name="train",
        request=SliceRequest("train", 4, mesh=(2, 2)),
        owner="client:7",
        mapping=(0, 1, 2, 3),
        status=SliceStatus.READY,
        reason="",
        history=(),
        generation=0,
    )
    assert (
        action.explanation
        == "island a: devices [0, 1, 2, 3] with loads [0, 0, 0, 0]; the only candidate island"
    )
    assert rm.slices["train"] == s


def test_island_preference_load_then_idle_then_name() -> None:
    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 6)), ("h3", "c", range(6, 10)))
    # b and c tie on load (0) and idle devices (4): name order; a has only 2 idle.
    action = create(rm, "s1", 2)
    assert isinstance(action, SliceCreated)
    assert action.slice.mapping == (2, 3)
    assert action.explanation == (
        "island b: devices [2, 3] with loads [0, 0]; "
        "other islands: c (tie, name order), a (idle devices 2 < 4)"
    )
    # Now b has load on two devices, c is idle: c wins on load.
    assert placed(rm, "s2", 4) == (6, 7, 8, 9)
    # 3 devices: a is too small; b has [4, 5, 2] total load 1, c total load 3.
    action = create(rm, "s3", 3)
    assert isinstance(action, SliceCreated)
    assert action.slice.mapping == (2, 4, 5)
    assert action.explanation == (
        "island b: devices [2, 4, 5] with loads [1, 0, 0]; "
        "other islands: c (total load 3 > 1), a (only 2 usable)"
    )


def test_island_and_kind_filters() -> None:
    rm = cluster(("h1", "a", range(4)), ("g1", "g", range(10, 12), "gpu"))
    action = create(rm, "s1", 2, island="a")
    assert isinstance(action, SliceCreated)
    assert action.slice.mapping == (0, 1)
    assert action.explanation == "island a: devices [0, 1] with loads [0, 0]; island a requested"
    assert placed(rm, "s2", 2, kind="gpu") == (10, 11)
    assert placed(rm, "s3", 1, kind="cpu") == (2,)


def test_slices_never_span_islands() -> None:
    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 4)))
    msg = rejected(create(rm, "big", 3), RejectCode.CAPACITY)
    assert msg == "needs 3 devices on one island; the largest island has 2 (island a, 2 free)"


def test_exclusive_takes_only_idle_devices_and_blocks_others() -> None:
    rm = cluster(("h1", "a", range(4)))
    assert placed(rm, "shared", 2) == (0, 1)
    assert placed(rm, "excl", 2, exclusive=True) == (2, 3)
    assert rm.exclusive_holder(2) == "excl" and rm.exclusive_holder(0) is None
    # Shared slices avoid exclusively held devices even though 0 and 1 are busier.
    assert placed(rm, "shared2", 2) == (0, 1)
    assert loads(rm) == {0: 2, 1: 2, 2: 1, 3: 1}
    # No other exclusive slice fits: every device is in use.
    msg = rejected(create(rm, "excl2", 1, exclusive=True), RejectCode.CAPACITY)
    assert msg == "needs 1 unshared devices on one island; the most any island has is 0 (island a)"
    msg = rejected(create(rm, "shared3", 3), RejectCode.CAPACITY)
    assert msg == "needs 3 devices on one island; the largest island has 4 (island a, 2 free)"


def test_exclusive_cannot_take_shared_devices() -> None:
    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 6)))
    assert placed(rm, "s", 1, island="b") == (2,)
    assert placed(rm, "e", 3, exclusive=True) == (3, 4, 5)
    msg = rejected(create(rm, "e2", 3, exclusive=True), RejectCode.CAPACITY)
    assert msg == "needs 3 unshared devices on one island; the most any island has is 2 (island a)"


def test_mesh_accepted_when_product_matches() -> None:
    rm = cluster(("h1", "a", range(8)))
    action = create(rm, "m", 8, mesh=(2, 4))
    assert isinstance(action, SliceCreated)
    assert action.slice.request.mesh == (2, 4)
    assert len(action.slice.mapping) == 8


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("request_", "owner", "code", "message"),
    [
        (SliceRequest("s", 0), "", RejectCode.INVALID, "devices must be positive, got 0"),
        (SliceRequest("s", -2), "", RejectCode.INVALID, "devices must be positive, got -2"),
        (
            SliceRequest("s", 4, mesh=(2, 3)),
            "",
            RejectCode.INVALID,
            "mesh (2, 3) has 6 devices, but 4 were requested",
        ),
        (
            SliceRequest("s", 4, mesh=(-2, -2)),
            "",
            RejectCode.INVALID,
            "mesh (-2, -2) must have at least one dimension, all positive",
        ),
        (
            SliceRequest("s", 1, mesh=()),
            "",
            RejectCode.INVALID,
            "mesh () must have at least one dimension, all positive",
        ),
        (SliceRequest("s", 1, island="z"), "", RejectCode.INVALID, "unknown island 'z'; known islands: a, g"),
        (
            SliceRequest("s", 1, kind="tpu"),
            "",
            RejectCode.INVALID,
            "unknown device kind 'tpu'; expected cpu or gpu",
        ),
        (
            SliceRequest("s", 1, island="a", kind="gpu"),
            "",
            RejectCode.INVALID,
            "island a has no gpu devices (it holds cpu)",
        ),
        (SliceRequest("Bad", 1), "", RejectCode.INVALID, "invalid slice name 'Bad'"),
        (SliceRequest("1abc", 1), "", RejectCode.INVALID, "invalid slice name '1abc'"),
        (SliceRequest("a_b", 1), "", RejectCode.INVALID, "invalid slice name 'a_b'"),
        (SliceRequest("a" * 64, 1), "", RejectCode.INVALID, "invalid slice name"),
        (SliceRequest("s", 1), "bob", RejectCode.INVALID, "invalid owner 'bob'"),
        (SliceRequest("s", 1), "client:", RejectCode.INVALID, "invalid owner 'client:'"),
        (SliceRequest("taken", 1), "", RejectCode.CONFLICT, "a slice named 'taken' already exists"),
        (
            SliceRequest("s", 5, island="a"),
            "",
            RejectCode.CAPACITY,
            "island a has 4 healthy devices; needs 5",
        ),
    ],
)
def test_bad_requests_are_rejected_without_changing_state(
    request_: SliceRequest, owner: str, code: RejectCode, message: str
) -> None:
    rm = cluster(("h1", "a", range(4)), ("g1", "g", range(10, 12), "gpu"))
    placed(rm, "taken", 1)
    before = copy.deepcopy(rm)
    for dry_run in (False, True):
        msg = rejected(
            create(
                rm,
                request_.name,
                request_.devices,
                owner=owner,
                dry_run=dry_run,
                mesh=request_.mesh,
                island=request_.island,
                kind=request_.kind,
            ),
            code,
        )
        assert msg.startswith(message), msg
        assert rm == before


def test_kind_matching_no_device_says_so() -> None:
    rm = cluster(("h1", "a", range(4)))
    msg = rejected(create(rm, "s", 1, kind="gpu"), RejectCode.INVALID)
    assert msg == "the cluster has no gpu devices"


def test_longest_valid_name_accepted() -> None:
    rm = cluster(("h1", "a", range(1)))
    placed(rm, "a" + "-0" * 31, 1)


def test_dry_run_changes_nothing_and_matches_real_placement() -> None:
    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 6)))
    placed(rm, "s1", 2, island="b")
    before = copy.deepcopy(rm)
    preview = create(rm, "", 2, dry_run=True)
    assert isinstance(preview, PlacementPreview)
    assert rm == before
    real = create(rm, "", 2)
    assert isinstance(real, SliceCreated)
    assert (preview.name, preview.mapping, preview.explanation) == (
        real.slice.name,
        real.slice.mapping,
        real.explanation,
    )
    assert preview.name == "slice-1"


def test_auto_names_skip_taken_and_are_not_reused() -> None:
    rm = cluster(("h1", "a", range(2)))
    assert placed(rm, "", 1) == (0,)
    assert "slice-1" in rm.slices
    placed(rm, "slice-2", 1)
    action = create(rm, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-3"
    assert action.slice.request.name == "slice-3"
    assert rm.handle(DeleteSlice("slice-1")) == [SliceDeleted("slice-1")]
    assert rm.handle(DeleteSlice("slice-3")) == [SliceDeleted("slice-3")]
    # never a deleted slice's name: a program or script holding "slice-3" must not reach a new slice
    action = create(rm, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-4"
    assert rm.handle(DeleteSlice("slice-2")) == [SliceDeleted("slice-2")]
    placed(rm, "slice-9", 1)  # named like an automatic one: the automatic ones go past it
    assert rm.handle(DeleteSlice("slice-9")) == [SliceDeleted("slice-9")]
    action = create(rm, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-10"
    preview = create(rm, "", 1, dry_run=True)  # a preview takes no name
    assert isinstance(preview, PlacementPreview) and preview.name == "slice-11"
    assert rm.handle(DeleteSlice("slice-10")) == [SliceDeleted("slice-10")]
    action = create(rm, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-11"
    # a restarted controller goes on past the highest slice it restores
    restored = cluster(("h1", "a", range(2)))
    restored.restore([(d, True) for d in rm._devices.values()], list(rm.slices.values()))
    action = create(restored, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-12"
    # ... and past the highest it ever gave, which the database keeps (deleted slices included)
    assert restored.handle(DeleteSlice("slice-12")) == [SliceDeleted("slice-12")]
    again = cluster(("h1", "a", range(2)))
    again.restore([(d, True) for d in restored._devices.values()], list(restored.slices.values()), auto_seq=12)
    action = create(again, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-13"
    # a chosen name past what the counter can hold is taken as any other name
    placed(again, "slice-" + "9" * 57, 1)
    action = create(again, "", 1)
    assert isinstance(action, SliceCreated) and action.slice.name == "slice-14"


# ------------------------------------------------------------------------------------------ capacity


def test_capacity_reason_examples() -> None:
    rm = cluster(("h1", "a", range(4)), ("h2", "b", range(4, 6)))
    assert rejected(create(rm, "s", 8), RejectCode.CAPACITY) == (
        "needs 8 devices on one island; the largest island has 4 (island a, 4 free)"
    )
    placed(rm, "busy", 2, island="a")  # a: two devices in use, two idle; b: two idle
    placed(rm, "busy2", 2, island="a")  # every device of a is in use now
    assert rejected(create(rm, "s", 4, exclusive=True), RejectCode.CAPACITY) == (
        "needs 4 unshared devices on one island; the most any island has is 2 (island b)"
    )


def test_capacity_reason_with_island_filter() -> None:
    rm = cluster(("h1", "a", range(4)))
    placed(rm, "e", 2, exclusive=True)
    assert rejected(create(rm, "s", 4, island="a"), RejectCode.CAPACITY) == (
        "island a has 4 healthy devices, 2 of them held exclusively; needs 4"
    )
    placed(rm, "s", 1, island="a")
    assert rejected(create(rm, "x", 2, island="a", exclusive=True), RejectCode.CAPACITY) == (
        "island a has 4 healthy devices, 3 of them in use; needs 2 unshared"
    )
    assert rejected(create(rm, "x", 5, island="a", kind="cpu", exclusive=True), RejectCode.CAPACITY) == (
        "island a has 4 healthy cpu devices, 3 of them in use; needs 5 unshared"
    )


def test_capacity_reason_free_counts_exclusive_holds() -> None:
    rm = cluster(("h1", "a", range(6)), ("h2", "b", range(6, 10)))
    placed(rm, "e", 4, exclusive=True, island="a")
    # a: 6 healthy, 2 free; b: 4 healthy, 4 free -> b is reported.
    assert rejected(create(rm, "s", 5), RejectCode.CAPACITY) == (
        "needs 5 devices on one island; the largest island has 4 (island b, 4 free)"
    )


def test_capacity_reason_with_kind_and_no_healthy_devices() -> None:
    rm = cluster(("g1", "g", range(4), "gpu"), ("h1", "a", range(4, 12)))
    assert rejected(create(rm, "s", 8, kind="gpu"), RejectCode.CAPACITY) == (
        "needs 8 gpu devices on one island; the largest island has 4 (island g, 4 free)"
    )
    rm.handle(HostLost("g1"))
    assert rejected(create(rm, "s", 2, kind="gpu"), RejectCode.CAPACITY) == (
        "needs 2 gpu devices on one island; no healthy gpu devices"
    )
    assert (
        rejected(create(rm, "s", 2, island="g"), RejectCode.CAPACITY)
        == "island g has 0 healthy devices; needs 2"
    )
    rm.handle(HostLost("h1"))
    assert (
        rejected(create(rm, "s", 2), RejectCode.CAPACITY)
        == "needs 2 devices on one island; no healthy devices"
    )


# ------------------------------------------------------------------------------------------- remapping


def test_host_loss_remaps_to_another_island() -> None:
    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 4)))
    assert placed(rm, "s", 2) == (0, 1)
    actions = rm.handle(HostLost("h1"))
    new = rm.slices["s"]
    assert actions == [SliceRemapped(new, (0, 1), "host h1 lost")]
    assert new.mapping == (2, 3)
    assert new.status == SliceStatus.REMAPPED
    assert new.reason == "host h1 lost"
    assert new.generation == 1
    assert new.history == (RemapRecord((0, 1), (2, 3), "host h1 lost"),)
    assert not rm.is_healthy(0) and rm.is_healthy(2)
    assert loads(rm) == {0: 0, 1: 0, 2: 1, 3: 1}


def test_host_loss_keeps_healthy_devices_in_place() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]), ("h3", "a", [4, 5]))
    assert placed(rm, "s", 4, mesh=(2, 2)) == (0, 1, 2, 3)
    [action] = rm.handle(HostLost("h1"))
    assert isinstance(action, SliceRemapped)
    # Virtual devices 2 and 3 stay where they were; 0 and 1 move.
    assert action.slice.mapping == (4, 5, 2, 3)


def test_host_loss_prefers_own_island() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3, 4]), ("h3", "b", range(5, 10)))
    assert placed(rm, "s", 2) == (0, 1)
    [action] = rm.handle(HostLost("h1"))
    # A fresh placement would choose b (more idle devices); staying on a is preferred.
    assert isinstance(action, SliceRemapped)
    assert action.slice.mapping == (2, 3)


def test_own_load_does_not_count_against_exclusive_remap() -> None:
    rm = cluster(("h1", "a", [0]), ("h2", "a", [1]), ("h3", "a", [2]))
    assert placed(rm, "e", 2, exclusive=True) == (0, 1)
    [action] = rm.handle(HostLost("h1"))
    assert isinstance(action, SliceRemapped)
    assert action.slice.mapping == (2, 1)  # keeps device 1 although it has load 1 (its own)
    assert rm.exclusive_holder(1) == rm.exclusive_holder(2) == "e"
    assert rm.exclusive_holder(0) is None


def test_host_loss_degrades_then_restores_on_return() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]))
    assert placed(rm, "s", 4) == (0, 1, 2, 3)
    actions = rm.handle(HostLost("h1"))
    s = rm.slices["s"]
    reason = "host h1 lost; needs 4 devices on one island; the largest island has 2 (island a, 2 free)"
    assert actions == [SliceDegraded(s, reason)]
    assert s.status == SliceStatus.DEGRADED and s.reason == reason
    assert s.mapping == (0, 1, 2, 3)  # kept for display
    assert s.generation == 0
    assert loads(rm) == {0: 0, 1: 0, 2: 0, 3: 0}  # a degraded slice holds nothing
    assert rm.handle(HostLost("h1")) == []  # already lost
    actions = rm.handle(HostUp("h1", devs("h1", "a", [0, 1])))
    s = rm.slices["s"]
    assert actions == [SliceRestored(s)]
    assert s.status == SliceStatus.READY and s.reason == ""
    assert s.mapping == (0, 1, 2, 3)
    assert s.generation == 1 and s.history == ()


def test_degraded_slice_restored_elsewhere_gets_history() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]))
    placed(rm, "s", 4)
    rm.handle(HostLost("h1"))
    actions = rm.handle(HostUp("h4", devs("h4", "a", [10, 11])))
    s = rm.slices["s"]
    assert actions == [SliceRestored(s)]
    assert s.status == SliceStatus.REMAPPED
    assert s.mapping == (10, 11, 2, 3)
    assert s.history == (RemapRecord((0, 1, 2, 3), (10, 11, 2, 3), "host h4 up"),)
    assert s.generation == 1


def test_degraded_slices_restored_in_creation_order() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]))
    placed(rm, "first", 2, exclusive=True)
    placed(rm, "second", 2, exclusive=True)
    rm.handle(HostLost("h1"))
    rm.handle(HostLost("h2"))
    assert {s.status for s in rm.slices.values()} == {SliceStatus.DEGRADED}
    actions = rm.handle(HostUp("h5", devs("h5", "a", [10, 11])))
    first = rm.slices["first"]
    assert actions == [SliceRestored(first)]
    assert first.mapping == (10, 11) and first.status == SliceStatus.REMAPPED
    assert rm.slices["second"].status == SliceStatus.DEGRADED


def test_deleting_exclusive_slice_restores_degraded_one() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]))
    placed(rm, "big", 4)
    rm.handle(HostLost("h1"))
    placed(rm, "e", 2, exclusive=True)  # takes 2, 3 while big is degraded
    rm.handle(HostUp("h1", devs("h1", "a", [0, 1])))
    assert rm.slices["big"].status == SliceStatus.DEGRADED  # 2 and 3 are held exclusively
    actions = rm.handle(DeleteSlice("e"))
    big = rm.slices["big"]
    assert actions == [SliceDeleted("e"), SliceRestored(big)]
    assert big.status == SliceStatus.READY and big.mapping == (0, 1, 2, 3)


def test_degrading_exclusive_slice_frees_devices_for_older_degraded_one() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]), ("h3", "b", [4]))
    placed(rm, "old", 2, island="a", exclusive=True)  # (0, 1)
    placed(rm, "e", 2, island="a", exclusive=True)  # (2, 3)
    rm.handle(HostLost("h1"))  # old degrades: a has no unshared device left
    assert rm.slices["old"].status == SliceStatus.DEGRADED
    rm.handle(HostUp("h1", devs("h1", "a", [0, 1])))
    assert rm.slices["old"].status == SliceStatus.READY
    # Both lose one device each when h2 goes; e degrades, and old, re-placed first, keeps its devices.
    actions = rm.handle(HostLost("h2"))
    assert [type(a) for a in actions] == [SliceDegraded]
    assert rm.slices["e"].status == SliceStatus.DEGRADED
    assert rm.slices["old"].mapping == (0, 1)


def test_host_reregistering_with_fewer_devices_remaps_its_slices() -> None:
    rm = cluster(("h1", "a", [0, 1, 2, 3]))
    assert placed(rm, "s", 2, island="a") == (0, 1)
    assert placed(rm, "t", 2) == (2, 3)
    actions = rm.handle(HostUp("h1", devs("h1", "a", [0, 2, 3])))
    s = rm.slices["s"]
    cause = "host h1 re-registered with different devices"
    assert actions == [SliceRemapped(s, (0, 1), cause)]
    assert s.mapping == (0, 2)
    assert not rm.is_healthy(1) and 1 in rm.devices
    assert rm.hosts["h1"] == (0, 1, 2, 3)  # 1 stays known, retired


def test_device_moving_island_on_reregistration_remaps_its_slices() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "b", [2, 3]))
    assert placed(rm, "s", 2, island="a") == (0, 1)
    actions = rm.handle(
        HostUp("h1", (PhysicalDevice(0, "a", "h1", "cpu"), PhysicalDevice(1, "b", "h1", "cpu")))
    )
    [action] = actions
    assert isinstance(action, SliceDegraded)
    assert action.reason == (
        "host h1 re-registered with different devices; island a has 1 healthy devices; needs 2"
    )


def test_unhealthy_device_may_move_to_another_host() -> None:
    rm = cluster(("h1", "a", [0, 1]))
    rm.handle(HostLost("h1"))
    assert rm.handle(HostUp("h2", devs("h2", "a", [1]))) == []
    assert rm.hosts == {"h1": (0,), "h2": (1,)}
    assert rm.is_healthy(1) and not rm.is_healthy(0)
    assert placed(rm, "s", 1) == (1,)


def test_host_up_is_idempotent() -> None:
    rm = cluster(("h1", "a", range(4)))
    placed(rm, "s", 2)
    before = copy.deepcopy(rm)
    assert rm.handle(HostUp("h1", devs("h1", "a", range(4)))) == []
    assert rm == before


@pytest.mark.parametrize(
    ("event", "code", "message"),
    [
        (HostUp("h2", devs("h1", "a", [9])), RejectCode.INVALID, "device 9 names host 'h1', not 'h2'"),
        (
            HostUp("h2", devs("h2", "a", [9], "gpu")),
            RejectCode.INVALID,
            "island a holds cpu devices (device 0); device 9 of host h2 is gpu",
        ),
        (
            HostUp("h2", devs("h2", "b", [9, 9])),
            RejectCode.INVALID,
            "host h2 lists a device id twice: [9, 9]",
        ),
        (HostUp("h2", devs("h2", "b", [1])), RejectCode.INVALID, "device 1 already belongs to host h1"),
        (
            HostUp("h2", devs("h2", "b", [9], "tpu")),
            RejectCode.INVALID,
            "device 9 has unknown kind 'tpu'; expected cpu or gpu",
        ),
        (HostUp("h2", devs("h2", "", [9])), RejectCode.INVALID, "device 9 has no island"),
        (HostUp("", ()), RejectCode.INVALID, "host name must not be empty"),
        (HostLost("nope"), RejectCode.NOT_FOUND, "no host named 'nope'"),
        (DeleteSlice("nope"), RejectCode.NOT_FOUND, "no slice named 'nope'"),
        (
            DeleteSlice("s", in_use="2 programs are running on it"),
            RejectCode.IN_USE,
            "slice s is in use (2 programs are running on it); force to delete it anyway",
        ),
        (ReleaseOwner(""), RejectCode.INVALID, "owner must not be empty"),
        (
            ReleaseOwner("someone"),
            RejectCode.INVALID,
            "invalid owner 'someone': expected '', 'client:<id>' or 'job:<id>'",
        ),
    ],
)
def test_bad_events_are_rejected_without_changing_state(event: Event, code: RejectCode, message: str) -> None:
    rm = cluster(("h1", "a", range(4)))
    placed(rm, "s", 2)
    before = copy.deepcopy(rm)
    [action] = rm.handle(event)
    assert rejected(action, code) == message
    assert rm == before


# --------------------------------------------------------------------------------- delete / release


def test_delete_in_use_refused_unless_forced() -> None:
    rm = cluster(("h1", "a", range(4)))
    placed(rm, "s", 2)
    assert rm.handle(DeleteSlice("s", force=True, in_use="a program is running")) == [SliceDeleted("s")]
    assert "s" not in rm.slices
    assert loads(rm) == {0: 0, 1: 0, 2: 0, 3: 0}
    placed(rm, "t", 1)
    assert rm.handle(DeleteSlice("t")) == [SliceDeleted("t")]


def test_release_owner_deletes_only_its_slices() -> None:
    rm = cluster(("h1", "a", range(4)))
    placed(rm, "c1", 1, owner="client:1")
    placed(rm, "j1", 1, owner="job:1")
    placed(rm, "named", 1)
    placed(rm, "c2", 1, owner="client:1")
    assert rm.handle(ReleaseOwner("client:1")) == [SliceDeleted("c1"), SliceDeleted("c2")]
    assert list(rm.slices) == ["j1", "named"]
    assert rm.handle(ReleaseOwner("client:1")) == []
    assert rm.handle(ReleaseOwner("job:1")) == [SliceDeleted("j1")]
    assert list(rm.slices) == ["named"]


# -------------------------------------------------------------------------------------------- restore


def _db_view(rm: ResourceManager) -> tuple[list[tuple[PhysicalDevice, bool]], list[Slice]]:
    return [(d, rm.is_healthy(d.id)) for d in rm.devices.values()], list(rm.slices.values())


def test_restore_round_trip() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "a", [2, 3]), ("h3", "b", [4, 5]))
    placed(rm, "", 2, owner="job:3")
    placed(rm, "e", 2, exclusive=True, island="b")
    placed(rm, "big", 4, island="a")
    placed(rm, "m", 1, island="a")
    rm.handle(HostLost("h2"))
    assert [s.status for s in rm.slices.values()] == [
        SliceStatus.READY,
        SliceStatus.READY,
        SliceStatus.DEGRADED,
        SliceStatus.REMAPPED,
    ]
    devices, slices = _db_view(rm)
    other = ResourceManager(debug=True)
    assert other.restore(devices, slices) == []
    assert other == rm
    # Both continue identically.
    for m in (rm, other):
        assert isinstance(create(m, "", 1), SliceCreated)
        m.handle(HostUp("h2", devs("h2", "a", [2, 3])))
    assert other == rm
    assert "slice-2" in rm.slices


def test_restore_with_unhealthy_devices_repairs_slices() -> None:
    rm = cluster(("h1", "a", [0, 1]), ("h2", "b", [2, 3]))
    placed(rm, "s", 2)
    devices = [(d, d.host != "h1") for d in rm.devices.values()]
    other = ResourceManager(debug=True)
    actions = other.restore(devices, rm.slices.values())
    cause = "device unhealthy at controller restart"
    assert actions == [SliceRemapped(other.slices["s"], (0, 1), cause)]
    assert other.slices["s"].mapping == (2, 3)


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ([Slice("s", SliceRequest("s", 1), "", (99,))], "slice s: unknown devices [99]"),
        ([Slice("s", SliceRequest("s", 2), "", (0, 0))], "slice s: duplicate devices in [0, 0]"),
        ([Slice("s", SliceRequest("s", 2), "", (0, 2))], "slice s: spans islands ['a', 'b']"),
        (
            [
                Slice("e", SliceRequest("e", 1, exclusive=True), "", (0,)),
                Slice("s", SliceRequest("s", 1), "", (0,)),
            ],
            "slice s shares devices [0] held exclusively",
        ),
        (
            [Slice("s", SliceRequest("s", 1), "", (0,)), Slice("s", SliceRequest("s", 1), "", (1,))],
            "slice s restored twice",
        ),
    ],
)
def test_restore_rejects_inconsistent_state(slices: list[Slice], message: str) -> None:
    rm = cluster(("h1", "a", [0, 1]))
    placed(rm, "keep", 1)
    before = copy.deepcopy(rm)
    devices = [(*devs("h1", "a", [0, 1]),), (*devs("h2", "b", [2]),)]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        rm.restore([(d, True) for group in devices for d in group], slices)
    assert rm == before


def test_validate_detects_broken_bookkeeping() -> None:
    rm = cluster(("h1", "a", range(2)))
    placed(rm, "s", 1)
    rm._load[1] = 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="load"):
        rm.validate()


# ----------------------------------------------------------------------------------------- randomized


def _random_event(
    rng: random.Random, rm: ResourceManager, hosts: dict[str, tuple[str, list[int], str]]
) -> Event:
    roll = rng.random()
    names = [*rm.slices, *rm.slices, "ghost"]
    if roll < 0.4:
        n = rng.choice([1, 1, 2, 2, 3, 4, 0, 6])
        mesh = rng.choice([None, None, None, None, (n,), (1, n), (2, 2), (0, n)])
        request = SliceRequest(
            name=rng.choice(["", "", "", "x", "y", "z", "slice-2", "Bad"]),
            devices=n,
            mesh=mesh,
            island=rng.choice([None, None, None, None, "a", "b", "g", "nope"]),
            kind=rng.choice([None, None, None, None, "cpu", "gpu", "tpu"]),
            exclusive=rng.random() < 0.25,
        )
        return CreateSlice(request, owner=rng.choice(["", "client:1", "job:2"]), dry_run=rng.random() < 0.1)
    if roll < 0.55:
        return DeleteSlice(rng.choice(names), force=rng.random() < 0.5, in_use=rng.choice([None, "busy"]))
    if roll < 0.6:
        return ReleaseOwner(rng.choice(["client:1", "job:2"]))
    host = rng.choice(sorted(hosts))
    if roll < 0.78:
        return HostLost(host)
    island, ids, kind = hosts[host]
    if rng.random() < 0.15:  # re-register with a changed device set
        ids = [i for i in ids if rng.random() < 0.7] + [100 + rng.randrange(20)]
    return HostUp(host, devs(host, island, ids, kind))


@pytest.mark.parametrize("seed", range(12))
def test_random_event_sequences_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    hosts = {
        "h1": ("a", [0, 1], "cpu"),
        "h2": ("a", [2, 3], "cpu"),
        "h3": ("b", [4, 5, 6], "cpu"),
        "h4": ("g", [7, 8], "gpu"),
    }
    rm = ResourceManager(debug=True)
    for host, (island, ids, kind) in hosts.items():
        rm.handle(HostUp(host, devs(host, island, ids, kind)))
    for _ in range(150):
        event = _random_event(rng, rm, hosts)
        before = copy.deepcopy(rm)
        actions = rm.handle(event)  # validate() runs inside (debug=True)
        if any(isinstance(a, Rejected) for a in actions):
            assert len(actions) == 1 and rm == before, (event, actions)
        if isinstance(event, CreateSlice) and event.dry_run:
            assert rm == before
        for a in actions:
            if isinstance(a, SliceRemapped | SliceRestored):
                assert a.slice.generation == before.slices[a.slice.name].generation + 1
                assert rm.slices[a.slice.name] == a.slice
            if isinstance(a, SliceDegraded):
                assert a.slice.mapping == before.slices[a.slice.name].mapping
        # The database view always rebuilds the same manager.
        devices, slices = _db_view(rm)
        other = ResourceManager(debug=True)
        assert other.restore(devices, slices) == []
        assert other == rm


def test_validation_failure_carries_the_stimuli_that_led_to_it() -> None:
    from server.resource_manager import InvariantError

    rm = cluster(("h1", "a", range(2)), ("h2", "b", range(2, 4)))
    placed(rm, "s", 2, island="a")
    rm._load[3] = 1  # corrupt on purpose: device 3 carries load no slice implies
    with pytest.raises(InvariantError) as caught:
        rm.handle(DeleteSlice("s"))  # validated after the stimulus (debug=True)
    err = caught.value
    assert err.problem.startswith("load {3: 1} != recomputed {}")
    assert [h.text for h in err.history] == [
        "HostUp h1 devices [0, 1]",
        "HostUp h2 devices [2, 3]",
        "CreateSlice s devices=2 island=a owner=''",
        "DeleteSlice s",
    ]
    assert "after these stimuli (oldest first)" in str(err) and "CreateSlice s devices=2" in str(err)


def test_validation_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATHWAYS_VALIDATE", "1")
    assert ResourceManager().debug
    monkeypatch.delenv("PATHWAYS_VALIDATE")
    assert not ResourceManager().debug


# ---- a mesh axis across hosts (--host-axis) ----


@pytest.mark.timeout(10)
def test_host_axis_puts_one_host_per_index_along_it() -> None:
    rm = cluster(("h1", "pod", range(1, 5)), ("h2", "pod", range(5, 9)), ("h3", "pod", range(9, 11)))
    rows = create(rm, "rows", 8, mesh=(2, 4), host_axis=0)
    assert isinstance(rows, SliceCreated)
    # row-major 2x4: row 0 on one host, row 1 on another (the 2-device host cannot hold a row)
    host = {d: h for h, ids in (("h1", range(1, 5)), ("h2", range(5, 9)), ("h3", range(9, 11))) for d in ids}
    m = rows.slice.mapping
    assert {host[d] for d in m[:4]} == {"h1"} and {host[d] for d in m[4:]} == {"h2"}, m
    cols = create(rm, "cols", 4, mesh=(2, 2), host_axis=1, island="pod")
    assert isinstance(cols, SliceCreated)
    c = cols.slice.mapping  # (i, j) at 2i+j: column j on one host
    assert host[c[0]] == host[c[2]] and host[c[1]] == host[c[3]] and host[c[0]] != host[c[1]], c


@pytest.mark.timeout(10)
def test_host_axis_is_checked_and_refused_when_hosts_are_too_small() -> None:
    rm = cluster(("h1", "pod", range(1, 3)), ("h2", "pod", range(3, 5)))
    bad = create(rm, "a", 4, mesh=(2, 2), host_axis=2)
    assert isinstance(bad, Rejected) and bad.code is RejectCode.INVALID and "host axis 2" in bad.message
    no_mesh = create(rm, "b", 4, host_axis=0)
    assert isinstance(no_mesh, Rejected) and "needs a mesh" in no_mesh.message
    too_big = create(rm, "c", 4, mesh=(1, 4), host_axis=0)  # one host with 4 devices: none has
    assert isinstance(too_big, Rejected) and too_big.code is RejectCode.CAPACITY, too_big
    assert "1 hosts with 4 usable devices" in too_big.message
