"""The pipeline's DHT report `StageLost`: pinned bytes, and every malformed report refused by its one validator."""

from __future__ import annotations

import pytest

from protocol import NodeIdentity, ProtocolRejection, Refusal, StageLost
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

GOLDEN_STAGE_LOST = (  # this minor's encoding (6): a change here breaks every deployed driver and server
    "92c4ab97920106aa73746167655f6c6f7374aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc09967"
    "e4d6309ba50d5f1ddc8664125531b803cb41d954fc4020000084a76e6f64655f6964d928353634373561613735343633"
    "34373463303238356466356462663262636162373364613635313335b16d6f64656c5f66696e6765727072696e74a974"
    "696e792d7177656eaa6e756d5f73746167657304a6737461676573920102c4409b192fed288a5cd8ecd3930987d454b9"
    "edaa93d10db5dad07f9a2fd5f7ebcd04d735aaef29dd506499d885e89b9eba1ac8e0adcf303ffbae7a6fe438638a820e"
)


def make_report(**overrides) -> StageLost:
    fields = {"node_id": IDENTITY.node_id, "model_fingerprint": "tiny-qwen", "num_stages": 4, "stages": [1, 2]}
    return StageLost(**{**fields, **overrides})


def test_golden_stage_lost():
    assert encode(make_report(), seq=3).hex() == GOLDEN_STAGE_LOST
    envelope = decode(bytes.fromhex(GOLDEN_STAGE_LOST))
    assert envelope.message == make_report() and envelope.kind == "stage_lost"
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_4)).message == make_report()
    assert decode(bytes.fromhex(GOLDEN_STAGE_LOST_1_5)).message == make_report()


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
    assert decode(encode(make_report(stages=[]))).message.stages == []
