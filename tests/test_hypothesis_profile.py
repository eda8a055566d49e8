"""The suite's Hypothesis profile (tests/conftest.py): no explain phase, which held 18.5 GB of RSS
for one failing property test of paged (the limit is 3 GB a worker); the other phases stay."""

from hypothesis import Phase, settings


def test_the_profile_leaves_out_only_the_explain_phase():
    phases = set(settings().phases)
    assert Phase.explain not in phases
    assert {Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink} <= phases
