"""Kimi delta attention (KDA): the gated delta rule with a decay per key channel (Kimi-Linear, Bailing-Hybrid)."""
