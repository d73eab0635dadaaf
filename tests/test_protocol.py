"""The wire protocol: golden bytes, round trips, every refusal reason, identities."""

from __future__ import annotations

import hashlib
import math
import os
import stat
import subprocess
import sys

import msgpack
import pytest

from protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Limits,
    NodeIdentity,
    PeerStats,
    ProtocolRejection,
    Refusal,
    RefusalCounter,
    ReplayGuard,
    RolloutCompletion,
    RolloutQuestion,
    node_id_from_public_key,
    verify_signature,
)
from tests.helpers.messages import IDENTITY, OTHER, SWARM, T0, decode, encode, make_batch, make_stats, signed


def _reframe_with_long_header() -> bytes:
    body, signature = msgpack.unpackb(encode(make_batch()))
    return b"\x92\xc6" + len(body).to_bytes(4, "big") + body + msgpack.packb(signature)  # bin32 where bin16 fits


def refusal(data: bytes, **kwargs) -> ProtocolRejection:
    with pytest.raises(ProtocolRejection) as caught:
        decode(data, **kwargs)
    return caught.value


GOLDEN_BATCH_1_0 = (  # as a 1.0 sender encoded it: every later minor must still decode it
    "92c5017297920100ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c44024c61c7a03bd2c5e"
    "62fa340c2386845bcfc3346b576a81707b2b3014db4ede74d3a4594f48972034de820ea28ef010cb8446fcb2dd6b6fec"
    "8a60951a5193b800"
)
GOLDEN_STATS_1_0 = (
    "92c5021397920100aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0015a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401c440b5a334a0ae8025a4b5127529e33697194f20ed10168e0a26f8e9b632c1e24ac13a380d64dfecdd"
    "819328cbb77d7809012746e79d81261735167197f7aa5ec104"
)

GOLDEN_BATCH_1_1 = (  # as a 1.1 sender encoded it
    "92c5017297920101ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c4405c34793cd42bfef8"
    "d4eb1f79176a83077d6220bbaa4dfa884d2dc05390f6fc80babc9bcd43776722bbe78748a230e889d6f6924955d0ebb9"
    "8f7819971c0c1400"
)
GOLDEN_STATS_1_1 = (  # a 1.1 heartbeat has no accuracy_by_dataset: the receiver reads {}
    "92c5021397920101aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0015a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401c4401b6621d8d9911cf3e132bc4d9bd5fa23b2e9f7c29dbedcdcc415fa9a5a7475f68816096c33310c"
    "1178daf531bfb8afe44975c21aaeede65b415c90b7b2060208"
)
GOLDEN_BATCH_1_2 = (  # as a 1.2 sender encoded it (minor 3 changed no field of a batch or a heartbeat)
    "92c5017297920102ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c44064dea7dab4d54c8b"
    "2708ea5c5d53c579c14a257055df1a76dccfe96c9d945d5767c5a8a8601a576572f8cc33536a193845ff2ec9115a865e"
    "27e293f1c34e3202"
)
GOLDEN_STATS_1_2 = (  # as a 1.2 sender encoded it
    "92c5025597920102aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0016a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000c440122fec5556dbf7ef6c11ae54f29f1723764943c6b8"
    "d95f4d5c8c3d43deb2a83c528a6698bc02fec7f2f2ffc4b0fbe275cd4fd815b4e2b15bbd30cf0c385a7100"
)

GOLDEN_BATCH_1_3 = (  # as a 1.3 sender encoded it (minor 4 added a message kind, no field of a batch or a heartbeat)
    "92c5017297920103ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440e7915f8c7cf8cec2"
    "74e99b3187994d4305addbe4da676b38ea8629feb574b76568d65b74916c8b65a428e69a461a4b254e2a95059c194b71"
    "4e1d9db4f232bd0d"
)

GOLDEN_BATCH_1_4 = (  # as a 1.4 sender encoded it (minor 5 added a heartbeat field)
    "92c5017297920104ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440772d8d90a1e97fed"
    "743b04dcfc98c40100b3d429d46ccc840d56f69f8cfe58a1c74503c267c8c743b2d8c078743a4fe4ac5bf0bc343f667c"
    "63d2268c8787dd03"
)

GOLDEN_BATCH_1_5 = (  # as a 1.5 sender encoded it (minor 6 changed the DHT key layout only, no field)
    "92c5017297920105ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440442b42bd8e18d385"
    "184e0fa314149033ce124e790004175041df8e1c4dc865510fb2360fa87ed18708968143d721b8f030baa4089cef7c0f"
    "5fc6d5b424d1950a"
)

GOLDEN_STATS_1_3 = (  # as a 1.3 sender encoded it
    "92c5025597920103aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0016a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000c44059b966b66a5ff94c8b6341f61fbf91f04b04e9c7f6"
    "e8d41db22693f166b0e118087806687ed9105dcebd7be01a04629defe9ef88aa6e3d12c1cb4aae5f654f08"
)

GOLDEN_STATS_1_4 = (  # as a 1.4 sender encoded it: no reachability, the receiver reads ""
    "92c5025597920104aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0016a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000c44033da74b3993abca38b6fd6c8dd82c74e552e6f9ae3"
    "a7e131cc93f5cfe7e4f5ce563cfd7e4616e0b45554c58ec2fb396b35afc81e55a11fe786f9e0188e6bca0e"
)

GOLDEN_STATS_1_5 = (  # as a 1.5 sender encoded it
    "92c5026397920105aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0017a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000ac72656163686162696c697479a0c440f24ab0f06ee922"
    "5e3a51143767796f33bd418c42953a20dfc77731008c2dfb16d0ecd699d03b8754bd8bf411a703deeb3a88e3cc61c810"
    "68bcf591413b3d6108"
)

GOLDEN_BATCH_1_6 = (  # as a 1.6 sender encoded it (minor 7 added a field to StageLost only)
    "92c5017297920106ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c4409b5d57ab6a7bfe56"
    "7d17a355cf6459e464d70a6b35301112e180908851fdedf394286f7f61d0bdae49f1f9421be46b4d21e483d17c90a9ce"
    "29458030606a100f"
)

GOLDEN_STATS_1_6 = (  # as a 1.6 sender encoded it
    "92c5026397920106aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0017a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000ac72656163686162696c697479a0c44034f5c08984be6c"
    "a40ec6ee8be3d00758534ee1dd7c5c341e001d53b702ea0e9786fc8d745705aac637a3a93921a0084df4f1b0a1c130df"
    "e7ebb36b184d6dc004"
)

GOLDEN_BATCH_1_7 = (  # as a 1.7 sender encoded it (minor 8 added a heartbeat field)
    "92c5017297920107ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440884f7f39a8051d40"
    "2e53d4a04e543f325fd5319d2db94f6d387eef9ef81beccca900122628b21f6a930d48140ec309c78cb9bf17c5ef2ea9"
    "35de7b4c0a55f503"
)

GOLDEN_STATS_1_7 = (  # as a 1.7 sender encoded it: no device, the receiver reads ""
    "92c5026397920107aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0017a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000ac72656163686162696c697479a0c440522e71dc53455c"
    "2a00ece15c46b1fb62c1459f2bd9310cbab359d35233dc62cf6f77a4a767d64f30a3fc5f703e051e42d62e5c99814fd9"
    "575dba3668cdf9ca04"
)

GOLDEN_BATCH_1_8 = (  # as a 1.8 sender encoded it (minor 9 added a heartbeat field)
    "92c5017297920108ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440cc622be446151c94"
    "a4d7cd59c13ff4ec0d637671734eff4ea68e93b3ea14f001dd6a3a673a9458a8dfcd42580e15724c8196c1d4154c5c67"
    "4f3595f0d6701c0c"
)

GOLDEN_STATS_1_8 = (  # as a 1.8 sender encoded it: no rejoins, the receiver reads 0
    "92c5028797920108aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0018a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000ac72656163686162696c697479a0a6646576696365bc63"
    "7564613a30204e5649444941204831303020383047422048424d33c4406618a16f5d7137c99a1f4c196bf86e910b4fd0"
    "500409feab0a80a4e6c2c3ad25a935e19e21d3f107544059ae5a429638e32771123fbdbff049b81035d153d203"
)

GOLDEN_BATCH = (  # this minor's encoding (9)
    "92c5017297920109ad726f6c6c6f75745f6261746368aa746573742d737761726dc42003a107bff3ce10be1d70dd18e7"
    "4bc09967e4d6309ba50d5f1ddc8664125531b801cb41d954fc4020000084a5726f756e6403ae706f6c6963795f766572"
    "73696f6e02b16d6f64656c5f66696e6765727072696e74a974696e792d7177656ea97175657374696f6e739183a47370"
    "656384a764617461736574b062617369635f61726974686d65746963a6636f6e66696781a96d696e5f7465726d7302a4"
    "7365656407a5696e64657801ab636f6d706c6574696f6e739284a474657874a134a9746f6b656e5f696473921302a86c"
    "6f6770726f627392cbbfe0000000000000cbbfd0000000000000ad66696e6973685f726561736f6ea473746f7084a474"
    "657874a466697665a9746f6b656e5f6964739114a86c6f6770726f6273c0ad66696e6973685f726561736f6ea66c656e"
    "677468af636c61696d65645f7265776172647392cb3ff0000000000000cb0000000000000000c440f266d98f5f95566c"
    "ef083eb304665f3855655fd4bbb1e88fc755e0c6fb88f359ff3a5e20157fb31cfa55f5b542026482c7b0aff0fe331eec"
    "322bf2f365a40f05"
)

GOLDEN_STATS = (  # this minor's encoding (9)
    "92c5029097920109aa706565725f7374617473aa746573742d737761726dc42003a107bff3ce10be1d70dd18e74bc099"
    "67e4d6309ba50d5f1ddc8664125531b802cb41d954fc40200000de0019a76e6f64655f6964d928353634373561613735"
    "34363334373463303238356466356462663262636162373364613635313335ac646973706c61795f6e616d65a5616c69"
    "6365b0736f6674776172655f76657273696f6ea5302e312e30b070726f746f636f6c5f76657273696f6ea3312e30aa6d"
    "6f64656c5f6e616d65a474696e79b06d6f64656c5f706172616d6574657273cd3039a5726f756e6403ae706f6c696379"
    "5f76657273696f6e02ab7265776172645f6d65616ecb3fe0000000000000a86163637572616379cb3fd0000000000000"
    "b2726f6c6c6f7574735f7075626c69736865640ab1726f6c6c6f7574735f726563656976656414b1726f6c6c6f757473"
    "5f61636365707465640fb1726f6c6c6f7574735f72656a656374656405ac746f6b656e735f7065725f73cb405ee00000"
    "000000a8757074696d655f73cb404e000000000000a96c6173745f7365656ecb41d954fc40000000a961646472657373"
    "657391b72f6970342f3132372e302e302e312f7463702f34303031b0676f737369705f61646472657373657391b72f69"
    "70342f3132372e302e302e312f7463702f34303032ab6f757465725f737465707304b36f757465725f73746570735f73"
    "6b697070656401b361636375726163795f62795f6461746173657482b062617369635f61726974686d65746963cb3fe0"
    "000000000000a9636861696e5f73756dcb3fc0000000000000ac72656163686162696c697479a0a6646576696365bc63"
    "7564613a30204e5649444941204831303020383047422048424d33a772656a6f696e7302c440ecb0fe9445fde1631ba0"
    "6eb87e2bcdf5e5dbc3f586948971da0f5ba05f51bff8eebcf06c11de5707f134431a13bb2b0b1f7278ef444449f2e2ee"
    "33bd5e89db03"
)

# --- golden bytes: the encoding is pinned; a change here breaks every deployed peer ----------------


def test_golden_rollout_batch():
    assert encode(make_batch()).hex() == GOLDEN_BATCH
    assert decode(bytes.fromhex(GOLDEN_BATCH)).message == make_batch()
    for older in (
        GOLDEN_BATCH_1_0,
        GOLDEN_BATCH_1_1,
        GOLDEN_BATCH_1_2,
        GOLDEN_BATCH_1_3,
        GOLDEN_BATCH_1_4,
        GOLDEN_BATCH_1_5,
        GOLDEN_BATCH_1_6,
        GOLDEN_BATCH_1_7,
        GOLDEN_BATCH_1_8,
    ):
        assert decode(bytes.fromhex(older)).message == make_batch()


def test_golden_peer_stats():
    assert encode(make_stats(), seq=2).hex() == GOLDEN_STATS
    assert decode(bytes.fromhex(GOLDEN_STATS)).message == make_stats()
    for older in (GOLDEN_STATS_1_0, GOLDEN_STATS_1_1):
        assert decode(bytes.fromhex(older)).message == make_stats(accuracy_by_dataset={}, device="", rejoins=0)
    for older in (
        GOLDEN_STATS_1_2,
        GOLDEN_STATS_1_3,
        GOLDEN_STATS_1_4,
        GOLDEN_STATS_1_5,
        GOLDEN_STATS_1_6,
        GOLDEN_STATS_1_7,
    ):
        assert decode(bytes.fromhex(older)).message == make_stats(device="", rejoins=0)
    assert decode(bytes.fromhex(GOLDEN_STATS_1_8)).message == make_stats(rejoins=0)


def test_reachability_is_one_of_its_words_and_required_from_minor_5():
    wire = make_stats(reachability="outbound-only").to_wire()
    assert PeerStats.from_wire(wire).reachability == "outbound-only"
    del wire["reachability"]
    assert PeerStats.from_wire(wire, minor=4).reachability == ""  # an older sender omits it
    with pytest.raises(ProtocolRejection, match="lacks reachability"):
        PeerStats.from_wire(wire, minor=5)
    for bad, reason in (
        ("public", Refusal.BAD_VALUE),
        (1, Refusal.BAD_STRUCTURE),
        ("x" * 300, Refusal.STRING_TOO_LONG),
    ):
        with pytest.raises(ProtocolRejection) as caught:
            PeerStats.from_wire({**wire, "reachability": bad})
        assert caught.value.reason is reason, bad


def test_device_is_a_bounded_string_required_from_minor_8():
    wire = make_stats(device="cpu").to_wire()
    assert PeerStats.from_wire(wire).device == "cpu"
    del wire["device"]
    assert PeerStats.from_wire(wire, minor=7).device == ""  # an older sender omits it
    with pytest.raises(ProtocolRejection, match="lacks device"):
        PeerStats.from_wire(wire, minor=8)
    for bad, reason in ((0, Refusal.BAD_STRUCTURE), ("x" * 300, Refusal.STRING_TOO_LONG)):
        with pytest.raises(ProtocolRejection) as caught:
            PeerStats.from_wire({**wire, "device": bad})
        assert caught.value.reason is reason, bad


def test_rejoins_is_a_count_required_from_minor_9():
    wire = make_stats(rejoins=3).to_wire()
    assert PeerStats.from_wire(wire).rejoins == 3
    del wire["rejoins"]
    assert PeerStats.from_wire(wire, minor=8).rejoins == 0  # an older sender omits it
    with pytest.raises(ProtocolRejection, match="lacks rejoins"):
        PeerStats.from_wire(wire, minor=9)
    for bad, reason in (("3", Refusal.BAD_STRUCTURE), (-1, Refusal.BAD_VALUE)):
        with pytest.raises(ProtocolRejection) as caught:
            PeerStats.from_wire({**wire, "rejoins": bad})
        assert caught.value.reason is reason, bad


def test_a_heartbeat_with_ten_thousand_addresses_is_refused():
    wire = make_stats(addresses=[f"/ip4/10.0.{i // 256}.{i % 256}/tcp/4001" for i in range(10_000)]).to_wire()
    with pytest.raises(ProtocolRejection) as caught:
        PeerStats.from_wire(wire)
    assert caught.value.reason is Refusal.TOO_MANY_ITEMS


def test_a_field_of_a_later_minor_is_required_from_its_senders_and_checked():
    wire = make_stats().to_wire()
    del wire["accuracy_by_dataset"]
    assert PeerStats.from_wire(wire, minor=1).accuracy_by_dataset == {}  # an older sender omits it
    with pytest.raises(ProtocolRejection, match="lacks accuracy_by_dataset"):
        PeerStats.from_wire(wire, minor=2)
    for bad, reason in (
        ({"x": 1.5}, Refusal.BAD_VALUE),
        ({"x": 1}, Refusal.BAD_STRUCTURE),
        ([0.5], Refusal.BAD_STRUCTURE),
        ({f"d{i}": 0.5 for i in range(33)}, Refusal.TOO_MANY_ITEMS),
        ({"x" * 300: 0.5}, Refusal.STRING_TOO_LONG),
    ):
        with pytest.raises(ProtocolRejection) as caught:
            PeerStats.from_wire({**wire, "accuracy_by_dataset": bad}, minor=2)
        assert caught.value.reason is reason, bad


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [make_batch(), make_batch(questions=[]), make_stats(), make_stats(addresses=[], reward_mean=-0.5)],
    ids=["batch", "empty", "stats", "bare"],
)
def test_round_trip(message):
    envelope = decode(encode(message, seq=9))
    assert envelope.message == message and type(envelope.message) is type(message)
    assert (envelope.version, envelope.kind, envelope.swarm_id, envelope.seq, envelope.timestamp) == (
        (PROTOCOL_MAJOR, PROTOCOL_MINOR),
        message.KIND,
        SWARM,
        9,
        T0,
    )
    assert envelope.sender == IDENTITY.public_key_bytes and envelope.sender_id == IDENTITY.node_id


def test_parts_round_trip_and_logprobs_none_is_not_empty():
    with_none, with_list = make_batch().questions[0].completions[1], RolloutCompletion("", [], [], "stop")
    for completion in (with_none, with_list):
        assert RolloutCompletion.from_wire(completion.to_wire()) == completion
    assert RolloutCompletion.from_wire(with_none.to_wire()).logprobs is None
    assert RolloutCompletion.from_wire(with_list.to_wire()).logprobs == []
    question = make_batch().questions[0]
    assert RolloutQuestion.from_wire(question.to_wire()) == question


def test_booleans_are_not_integers_and_integers_are_not_floats():
    for bad in (make_batch(round=True), make_stats(model_parameters=False), make_stats(uptime_s=60)):
        with pytest.raises(ProtocolRejection) as caught:
            encode(bad)
        assert caught.value.reason is Refusal.BAD_STRUCTURE
    wire = make_batch().to_wire()
    wire["questions"][0]["completions"][0]["token_ids"] = [True, 2]
    assert refusal(signed(wire)).reason is Refusal.BAD_STRUCTURE
    wire = make_batch().to_wire()
    wire["questions"][0]["claimed_rewards"] = [1, 0.0]
    assert refusal(signed(wire)).reason is Refusal.BAD_STRUCTURE


def test_encode_refuses_what_peers_would_refuse():
    with pytest.raises(ProtocolRejection, match="bad_value"):
        encode(make_stats(accuracy=math.nan))
    big = make_batch(questions=make_batch().questions * 64)
    with pytest.raises(ProtocolRejection) as caught:
        encode(big, limits=Limits(max_message_bytes=10_000))
    assert caught.value.reason is Refusal.TOO_LARGE
    with pytest.raises(TypeError):
        encode(make_batch().questions[0])


# --- every refusal reason reachable, and counted --------------------------------------------------


def _mutate(data: bytes, needle: bytes, replacement: bytes) -> bytes:
    assert data.count(needle) == 1 and len(needle) == len(replacement)
    return data.replace(needle, replacement)


def _with_payload(**changes) -> dict:
    wire = make_batch().to_wire()
    wire.update(changes)
    return wire


CASES = {
    "oversize": (Refusal.TOO_LARGE, lambda: (encode(make_batch()), {"limits": Limits(max_message_bytes=100)})),
    "garbage": (Refusal.NOT_MSGPACK, lambda: (b"\xc1\xc1 not msgpack", {})),
    "truncated": (Refusal.NOT_MSGPACK, lambda: (encode(make_batch())[:-1], {})),
    "trailing": (Refusal.NOT_MSGPACK, lambda: (encode(make_batch()) + b"\x00", {})),
    "ext type": (Refusal.BAD_STRUCTURE, lambda: (signed({"x": msgpack.ExtType(5, b"ab")}), {})),
    "not a frame": (Refusal.BAD_STRUCTURE, lambda: (msgpack.packb({"body": b"", "signature": b""}), {})),
    "repeated key": (Refusal.BAD_STRUCTURE, lambda: (signed(None, raw_payload=b"\x82\xa1a\x01\xa1a\x02"), {})),
    "non-canonical frame": (Refusal.BAD_STRUCTURE, lambda: (_reframe_with_long_header(), {})),
    "wrong type": (Refusal.BAD_STRUCTURE, lambda: (signed(_with_payload(round="3")), {})),
    "missing field": (Refusal.BAD_STRUCTURE, lambda: (signed({"round": 1}), {})),
    "extra field same minor": (Refusal.BAD_STRUCTURE, lambda: (signed(_with_payload(colour="red")), {})),
    "extra body field same minor": (Refusal.BAD_STRUCTURE, lambda: (signed(make_batch().to_wire(), extra=[1]), {})),
    "unknown major": (Refusal.UNKNOWN_VERSION, lambda: (signed(make_batch().to_wire(), version=(2, 0)), {})),
    "unknown kind": (Refusal.UNKNOWN_KIND, lambda: (signed({}, kind="averaging_announce"), {})),
    "wrong swarm": (Refusal.WRONG_SWARM, lambda: (encode(make_batch()), {"swarm_id": "other-swarm"})),
    "flipped signature": (Refusal.BAD_SIGNATURE, lambda: (encode(make_batch())[:-1] + b"\x01", {})),
    "flipped payload": (Refusal.BAD_SIGNATURE, lambda: (_mutate(encode(make_batch()), b"tiny-qwen", b"tiny-qwem"), {})),
    "other key": (
        Refusal.BAD_SIGNATURE,
        lambda: (_mutate(encode(make_batch()), IDENTITY.public_key_bytes, OTHER.public_key_bytes), {}),
    ),
    "expected other sender": (
        Refusal.SENDER_MISMATCH,
        lambda: (encode(make_batch()), {"expected_sender": OTHER.public_key_bytes}),
    ),
    "stats claim another node": (Refusal.SENDER_MISMATCH, lambda: (encode(make_stats(OTHER)), {})),
    "stale": (Refusal.STALE, lambda: (encode(make_batch()), {"now": T0 + DEFAULT_LIMITS.max_clock_skew_s + 1})),
    "from the future": (Refusal.STALE, lambda: (encode(make_batch()), {"now": T0 - 301})),
    "too many questions": (
        Refusal.TOO_MANY_ITEMS,
        lambda: (encode(make_batch(questions=make_batch().questions * 2)), {"limits": Limits(max_questions=1)}),
    ),
    "too many addresses": (
        Refusal.TOO_MANY_ITEMS,
        lambda: (signed({**make_stats().to_wire(), "addresses": ["/ip4/1.2.3.4"] * 17}, kind="peer_stats"), {}),
    ),
    "text too long": (Refusal.STRING_TOO_LONG, lambda: (encode(make_batch()), {"limits": Limits(max_string_chars=3)})),
    "name too long": (Refusal.STRING_TOO_LONG, lambda: (signed(_with_payload(model_fingerprint="x" * 65)), {})),
    "nan reward": (
        Refusal.BAD_VALUE,
        lambda: (
            signed(
                _with_payload(questions=[{**make_batch().questions[0].to_wire(), "claimed_rewards": [math.nan, 0.0]}])
            ),
            {},
        ),
    ),
    "positive logprob": (
        Refusal.BAD_VALUE,
        lambda: (
            signed(
                _with_payload(
                    questions=[
                        {
                            **make_batch().questions[0].to_wire(),
                            "completions": [
                                {**make_batch().questions[0].completions[0].to_wire(), "logprobs": [0.5, -1.0]}
                            ],
                            "claimed_rewards": [1.0],
                        }
                    ]
                )
            ),
            {},
        ),
    ),
    "negative round": (Refusal.BAD_VALUE, lambda: (signed(_with_payload(round=-1)), {})),
    "no completions": (
        Refusal.BAD_VALUE,
        lambda: (
            signed(
                _with_payload(
                    questions=[{**make_batch().questions[0].to_wire(), "completions": [], "claimed_rewards": []}]
                )
            ),
            {},
        ),
    ),
    "bad spec": (
        Refusal.BAD_SPEC,
        lambda: (
            signed(
                _with_payload(
                    questions=[
                        {
                            **make_batch().questions[0].to_wire(),
                            "spec": {"dataset": "", "config": {}, "seed": 0, "index": 0},
                        }
                    ]
                )
            ),
            {},
        ),
    ),
    "deep spec config": (
        Refusal.BAD_SPEC,
        lambda: (
            signed(
                _with_payload(
                    questions=[
                        {
                            **make_batch().questions[0].to_wire(),
                            "spec": {"dataset": "d", "config": {"a": _nested(1000)}, "seed": 0, "index": 0},
                        }
                    ]
                )
            ),
            {},
        ),
    ),
}


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("case", CASES)
def test_refusal(case):
    reason, make = CASES[case]
    data, kwargs = make()
    rejection = refusal(data, **kwargs)
    assert rejection.reason is reason, str(rejection)
    assert str(rejection).startswith(f"{reason.value}: ")


def test_every_reason_is_reachable_and_counted():
    counter = RefusalCounter()
    for i, (_, make) in enumerate(CASES.values()):
        data, kwargs = make()
        counter.record("peer-a" if i % 2 else "peer-b", refusal(data, **kwargs))
    guard = ReplayGuard()
    guard.check_and_record(decode(encode(make_batch(), seq=5)))
    with pytest.raises(ProtocolRejection) as caught:
        guard.check_and_record(decode(encode(make_batch(), seq=5)))
    counter.record("peer-a", caught.value)
    counter.record("peer-b", Refusal.UNSCORABLE)  # the node's reason, when a spec cannot be materialized
    # the DHT reader's reason (tests/test_crowd.py), from the key a value is stored under
    counter.record("peer-b", Refusal.WRONG_SHARD)
    assert set(counter.by_reason()) == {reason.value for reason in Refusal}
    assert sum(counter.by_reason().values()) == len(CASES) + 3
    assert counter.by_peer()["peer-a"]["replay"] == 1


def test_higher_minor_is_accepted_and_its_appended_fields_ignored():
    payload = _with_payload(colour="red")
    payload["questions"][0]["completions"][0]["score"] = 1
    payload["questions"][0]["spec"]["difficulty"] = 3
    envelope = decode(signed(payload, version=(PROTOCOL_MAJOR, PROTOCOL_MINOR + 1), extra=["future field"]))
    assert envelope.version == (PROTOCOL_MAJOR, PROTOCOL_MINOR + 1) and envelope.message == make_batch()


def test_replay_guard():
    guard = ReplayGuard(max_senders=2)
    guard.check_and_record(decode(encode(make_batch(), seq=5)))
    for seq in (5, 4):
        with pytest.raises(ProtocolRejection, match="replay"):
            guard.check_and_record(decode(encode(make_batch(), seq=seq)))
    guard.check_and_record(decode(encode(make_batch(), seq=6)))
    guard.check_and_record(decode(encode(make_stats(), seq=1)))  # seq counts per kind
    guard.check_and_record(decode(encode(make_stats(OTHER), seq=1, identity=OTHER)))  # evicts the oldest pair
    guard.check_and_record(decode(encode(make_batch(), seq=1)))


def test_refusal_codes_and_sentences():
    for reason in Refusal:
        assert reason.value.replace("_", "").isalpha() and reason.value.islower()
        assert reason.sentence.endswith(".") and len(reason.sentence) > 20
        assert Refusal(reason.value) is reason
    assert str(ProtocolRejection(Refusal.REPLAY, "seq 3")) == "replay: seq 3"


def test_refusal_counter_is_bounded_per_peer():
    counter = RefusalCounter(max_peers=2)
    for peer in ("a", "b", "c"):
        counter.record(peer, ProtocolRejection(Refusal.STALE))
    assert counter.by_reason() == {"stale": 3} and set(counter.by_peer()) == {"b", "c"}


def test_decode_refuses_non_bytes():
    assert refusal("a string").reason is Refusal.NOT_MSGPACK  # type: ignore[arg-type]
    assert decode(bytearray(encode(make_batch()))).message == make_batch()


# --- identity -------------------------------------------------------------------------------------


def test_node_id_derivation():
    key = IDENTITY.public_key_bytes
    assert len(key) == 32 and IDENTITY.node_id == hashlib.sha256(key).hexdigest()[:40]
    assert node_id_from_public_key(key) == IDENTITY.node_id != OTHER.node_id
    with pytest.raises(ValueError):
        node_id_from_public_key(key[:31])


def test_sign_and_verify():
    signature = IDENTITY.sign(b"data")
    assert verify_signature(IDENTITY.public_key_bytes, signature, b"data")
    assert not verify_signature(IDENTITY.public_key_bytes, signature, b"datb")
    assert not verify_signature(OTHER.public_key_bytes, signature, b"data")
    assert not verify_signature(b"short", signature, b"data")
    assert not verify_signature(IDENTITY.public_key_bytes, b"short", b"data")


def test_load_or_create(tmp_path):
    path = tmp_path / "keys" / "node.pem"
    first = NodeIdentity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert NodeIdentity.load_or_create(path).node_id == first.node_id
    assert [p.name for p in path.parent.iterdir()] == ["node.pem"]  # no temporary file left behind
    assert first.node_id in repr(first) and "PRIVATE" not in repr(first)


def test_load_raw_key_and_refuse_open_permissions(tmp_path):
    raw = tmp_path / "node.key"
    raw.write_bytes(bytes(range(32)))
    raw.chmod(0o600)
    assert NodeIdentity.load_or_create(raw).node_id == IDENTITY.node_id
    raw.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        NodeIdentity.load_or_create(raw)
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    junk.chmod(0o600)
    with pytest.raises(ValueError):
        NodeIdentity.load_or_create(junk)


def test_import_does_not_pull_torch():
    code = "import protocol, sys; assert 'torch' not in sys.modules, 'protocol imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_announcements_carry_dialable_addresses_from_minor_3():
    from protocol import AveragingReady
    from protocol.messages import StageAnnouncement

    ready = AveragingReady(
        p2p_peer_id="12D3KooWPeer", round=4, state="free", p2p_maddrs=["/ip4/198.18.1.2/tcp/4001/p2p/12D3KooWPeer"]
    )
    assert AveragingReady.from_wire(ready.to_wire()) == ready
    older = {k: v for k, v in ready.to_wire().items() if k != "p2p_maddrs"}
    # a 1.2 sender: nothing to dial, the call goes by peer id
    assert AveragingReady.from_wire(older, minor=2).p2p_maddrs == []
    with pytest.raises(ProtocolRejection, match="lacks p2p_maddrs"):
        AveragingReady.from_wire(older, minor=3)
    for bad, reason in (
        (["/ip4/1.2.3.4/tcp/1"] * 17, Refusal.TOO_MANY_ITEMS),
        (["x" * 300], Refusal.STRING_TOO_LONG),
        ("/ip4/1.2.3.4", Refusal.BAD_STRUCTURE),
    ):
        with pytest.raises(ProtocolRejection) as caught:
            AveragingReady.from_wire({**ready.to_wire(), "p2p_maddrs": bad})
        assert caught.value.reason is reason, bad
    stage = StageAnnouncement(
        node_id=IDENTITY.node_id,
        p2p_peer_id="12D3KooWStage",
        model_fingerprint="m",
        num_stages=2,
        stage=1,
        stage_fingerprint="s",
        layer_start=2,
        layer_end=4,
        parts=["layers", "head"],
        state="serving",
        step=3,
        grad_norm=0.5,
        samples_per_s=1.0,
        recoveries=0,
        replicas=[],
        p2p_maddrs=["/ip4/198.18.1.3/tcp/4001"],
    )
    assert StageAnnouncement.from_wire(stage.to_wire()) == stage
    assert (
        StageAnnouncement.from_wire({k: v for k, v in stage.to_wire().items() if k != "p2p_maddrs"}, minor=2).p2p_maddrs
        == []
    )
