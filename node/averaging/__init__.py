"""NoLoCo / DiLoCo weight averaging: outer optimizers (`outer`), what travels (`codec`),
checks on a partner's weights (`validation`), the averaging namespace (`fingerprint`) and
the exchange itself (`pairing`, which imports hivemind: import it explicitly)."""
