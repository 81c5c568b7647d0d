"""Training state: capturing Stateful objects as plain data, modules, EMA and RNG."""
