"""NoLoCo / DiLoCo weight averaging: outer optimizers (`outer`), what travels (`codec`),
checks on a partner's weights (`validation`), the averaging namespace (`fingerprint`) and
the averager of a round (`pairing`), which finds partners (`matchmaking`) and trades weights with them
(`exchange`); these three import hivemind: import them explicitly."""
