"""The pipeline's DHT report `StageLost`: pinned bytes, and every malformed report refused by its one validator; and
the chained stage calls' fields, each malformed one refused."""

from __future__ import annotations

import pytest

from protocol import NodeIdentity, ProtocolRejection, Refusal, StageLost
from protocol.pipeline import MAX_ROUTE_HOPS, PIPELINE_VERSION, RouteHop, StageCall
from tests.helpers.messages import IDENTITY, decode, encode, signed

GOLDEN_STAGE_LOST_1_4 = (  # as a 1.4 sender encoded it (minor 5 changed no field of a report)
    "92c4ab97920104aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000084a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102c440f3dea236dc7cee9d1afe6d851cf19705"
    "1815fdb5e51338af7918cb8aa99ae4af539d765be683e2ba304de37af38f255d188ac435f7c8b00948672986b1c99a0b"
)

GOLDEN_STAGE_LOST_1_5 = (  # as a 1.5 sender encoded it (minor 6 changed the DHT key layout only, no field of a report)
    "92c4ab97920105aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000084a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102c440e4c39d1e3d9045d6f63d08a1ed426257"
    "d0abe2c5a6e5a12c655a30cf8b9421d0f9acfc55a42efead72bf266cc8cc26afe126278180e227557d33d7ce35090705"
)

GOLDEN_STAGE_LOST_1_6 = (  # as a 1.6 sender encoded it: no lost_at, the stages count as lost when it was signed
    "92c4ab97920106aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000084a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102c4409b192fed288a5cd8ecd3930987d454b9"
    "edaa93d10db5dad07f9a2fd5f7ebcd04d735aaef29dd506499d885e89b9eba1ac8e0adcf303ffbae7a6fe438638a820e"
)


GOLDEN_STAGE_LOST_1_7 = (  # as a 1.7 sender encoded it (minor 8 changed no field of a report)
    "92c4c697920107aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c4402c027f1286759572738d39e56c27614c99c77a65355c52d2fb293a4e2486bf215c6840ff78"
    "f24fd445a9b83c521ee85236b2e39d0e424636779a5923f36c560a"
)


GOLDEN_STAGE_LOST_1_8 = (  # as a 1.8 sender encoded it (minor 9 changed no field of a report)
    "92c4c697920108aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c44009fde3a9434323f616d4432aeea6bfa97193c08b3142666ea454c535c5a68b3e01c08ad469"
    "3f426f45ce1d50d8ab2c08020e4c10e421261ad519ef9f7e8f7207"
)


GOLDEN_STAGE_LOST_1_9 = (  # as a 1.9 sender encoded it (minor 10 changed no field of a report)
    "92c4c697920109aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c440fe70280e02377d5adda038903787a33db8f9ab56795466c64f97c090a11a1f515d984c31b0"
    "3cf49405cfcc31163351faf582f525d69c2a0b0af4bddd967cb902"
)


GOLDEN_STAGE_LOST_1_10 = (  # as a 1.10 sender encoded it (minor 11 changed no field of a report)
    "92c4c69792010aaa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c440e29e3c0c30d6859139d6e55f764b7feddd86500ae7d02b0c7b750062980544e3814b798c7d"
    "16d672a9462841befa1b4ed627375a1d48ee81f4aeaab73713320f"
)


GOLDEN_STAGE_LOST_1_11 = (  # as a 1.11 sender encoded it (minor 12 changed no field of a report)
    "92c4c69792010baa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c440b0233fdf7bedb3dabe94d200a51b917038c620dbcac3b260ee94efe2adac6988285f3aeccc"
    "bf89cdc2088ada043f362240849dcb51586d79e28aaeb7f4e9c20b"
)


GOLDEN_STAGE_LOST = (  # this minor's encoding (12): a change here breaks every deployed driver and server
    "92c4c69792010caa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000085a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102a76c6f73745f617492cb41d954fc40200000"
    "cb41d954fc40d00000c440b99a291d91e35437364dcda5a0c719925671c6c63598c20afe8223b02c5421346fcc0a122c"
    "392261a6ebf686aa1957faafb39b5e703ee561507aa4b3ac404b02"
)


def make_report(**overrides) -> StageLost:
    fields = {
        "node_id": IDENTITY.node_id,
        "model_fingerprint": "tiny-qwen",
        "num_stages": 4,
        "stages": [1, 2],
        "lost_at": [1_700_000_000.5, 1_700_000_003.25],
    }
    return StageLost(**{**fields, **overrides})


def test_golden_stage_lost():
    assert encode(make_report(), seq=3).hex() == GOLDEN_STAGE_LOST
    envelope = decode(bytes.fromhex(GOLDEN_STAGE_LOST))
    assert envelope.message == make_report() and envelope.kind == "stage_lost"
    for older in (GOLDEN_STAGE_LOST_1_4, GOLDEN_STAGE_LOST_1_5, GOLDEN_STAGE_LOST_1_6):
        assert decode(bytes.fromhex(older)).message == make_report(lost_at=[])
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_7)).message == make_report()
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_8)).message == make_report()
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_9)).message == make_report()
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_10)).message == make_report()
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_11)).message == make_report()


def test_each_stage_counts_as_lost_from_when_it_was_found_and_never_after_the_report_was_signed():
    assert make_report().times(signed_at=1_700_000_010.0) == {1: 1_700_000_000.5, 2: 1_700_000_003.25}
    # a time after the signature is taken as the signature's: a report cannot hide announcements made after it
    assert make_report().times(signed_at=1_700_000_001.0) == {1: 1_700_000_000.5, 2: 1_700_000_001.0}
    # an older sender's report has no times: every stage counts from its signature
    assert make_report(lost_at=[]).times(signed_at=1_700_000_010.0) == {1: 1_700_000_010.0, 2: 1_700_000_010.0}
    assert decode(encode(make_report(lost_at=[]))).message.lost_at == []  # the same, from this minor


@pytest.mark.parametrize(
    "payload, reason",
    [
        ({**make_report().to_wire(), "stages": [4]}, Refusal.BAD_VALUE),  # outside [0, S)
        ({**make_report().to_wire(), "stages": [-1]}, Refusal.BAD_VALUE),
        ({**make_report().to_wire(), "stages": [1, 1]}, Refusal.BAD_VALUE),  # a repeated stage
        ({**make_report().to_wire(), "stages": list(range(65))}, Refusal.TOO_MANY_ITEMS),
        ({**make_report().to_wire(), "stages": [True]}, Refusal.BAD_STRUCTURE),  # a boolean is not a stage index
        ({**make_report().to_wire(), "num_stages": 0}, Refusal.BAD_VALUE),
        ({**make_report().to_wire(), "node_id": "not-hex"}, Refusal.BAD_VALUE),
        ({k: v for k, v in make_report().to_wire().items() if k != "stages"}, Refusal.BAD_STRUCTURE),
        ({k: v for k, v in make_report().to_wire().items() if k != "lost_at"}, Refusal.BAD_STRUCTURE),  # minor 7 has it
        ({**make_report().to_wire(), "lost_at": [1.0]}, Refusal.BAD_VALUE),  # one time for two stages
        ({**make_report().to_wire(), "lost_at": [1.0, -1.0]}, Refusal.BAD_VALUE),
        ({**make_report().to_wire(), "lost_at": [1.0, float("nan")]}, Refusal.BAD_VALUE),
        ({**make_report().to_wire(), "lost_at": [1.0, 2]}, Refusal.BAD_STRUCTURE),  # an int is not a time
    ],
)
def test_malformed_reports_are_refused(payload, reason):
    with pytest.raises(ProtocolRejection) as refused:
        decode(signed(payload, kind="stage_lost"))
    assert refused.value.reason is reason


def test_a_report_is_signed_by_the_driver_it_names():
    other = NodeIdentity.generate()
    with pytest.raises(ProtocolRejection) as refused:
        decode(signed(make_report(node_id=other.node_id).to_wire(), kind="stage_lost"))
    assert refused.value.reason is Refusal.SENDER_MISMATCH


def test_an_empty_report_withdraws():
    assert decode(encode(make_report(stages=[], lost_at=[]))).message.stages == []


# chained pipeline calls (protocol/pipeline.py "Chained calls") ----------------------------------------------------


def chained_call(**overrides) -> dict:
    hop = RouteHop(stage=2, stage_fingerprint="f2", peer_id="Qm" + "b" * 44, call_id="c-2", parts=["layers", "head"])
    call = StageCall(
        v=PIPELINE_VERSION,
        op="forward",
        stage=1,
        stage_fingerprint="f1",
        call_id="c-1",
        parts=["layers"],
        train=True,
        tensors={},
        scale=1.0,
        origin="Qm" + "a" * 44,
        route=[hop],
    ).to_wire()
    call.update(overrides)
    return call


def test_a_chained_call_round_trips():
    decoded = StageCall.from_wire(chained_call())
    assert decoded.chained and decoded.origin == "Qm" + "a" * 44
    assert decoded.route[0].peer_id == "Qm" + "b" * 44 and decoded.route[0].parts == ["layers", "head"]
    assert decoded.to_wire() == chained_call()
    assert not StageCall.from_wire(chained_call(origin="", route=[])).chained


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"v": 1}, Refusal.UNKNOWN_VERSION),  # a version-1 caller knows no chains and no collect
        ({"op": "step"}, Refusal.BAD_VALUE),  # only forwards and backwards are chained
        ({"op": "collect"}, Refusal.BAD_VALUE),
        ({"origin": ""}, Refusal.BAD_VALUE),  # a route without an origin
        ({"origin": "Q" * 65}, Refusal.STRING_TOO_LONG),
        ({"route": [{"stage": 2}]}, Refusal.BAD_STRUCTURE),
        ({"route": "Qm"}, Refusal.BAD_STRUCTURE),
        ({"route": [chained_call()["route"][0]] * (MAX_ROUTE_HOPS + 1)}, Refusal.TOO_MANY_ITEMS),
        ({"route": [dict(chained_call()["route"][0], parts=["tail"])]}, Refusal.BAD_VALUE),
        ({"route": [dict(chained_call()["route"][0], parts=["head", "head"])]}, Refusal.BAD_VALUE),
        ({"route": [dict(chained_call()["route"][0], peer_id="Q" * 65)]}, Refusal.STRING_TOO_LONG),
        ({"route": [dict(chained_call()["route"][0], stage=-1)]}, Refusal.BAD_VALUE),
        ({"route": [dict(chained_call()["route"][0], extra=1)]}, Refusal.BAD_STRUCTURE),
    ],
)
def test_malformed_chained_calls_are_refused(overrides, reason):
    with pytest.raises(ProtocolRejection) as refused:
        StageCall.from_wire(chained_call(**overrides))
    assert refused.value.reason is reason
