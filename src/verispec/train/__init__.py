"""Drafter training: self-distillation data with cached target features, EAGLE-3 / DFlash / DSpark training."""
