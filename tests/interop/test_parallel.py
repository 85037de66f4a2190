"""mindkit's rank layout (src/train/parallel.rs, printed by examples/rank_groups) against
megatron-core's own RankGenerator: every group kind the decoder's parallel state forms, for
layouts of up to 64 ranks."""
import json
import subprocess

import pytest
from conftest import example
from megatron.core.parallel_state import RankGenerator

LAYOUTS = [(w, tp, pp, cp) for w in (1, 2, 4, 6, 8, 12, 16, 24, 32, 64) for tp in (1, 2, 4, 8)
           for pp in (1, 2, 3, 4) for cp in (1, 2) if w % (tp * pp * cp) == 0]


@pytest.fixture(scope="session")
def rank_groups():
    return example("rank_groups")


def test_rank_groups_equal_megatron_cores(rank_groups):
    assert len(LAYOUTS) > 100
    for world, tp, pp, cp in LAYOUTS:
        ours = json.loads(subprocess.run([rank_groups, str(world), str(tp), str(pp), str(cp)],
                                         capture_output=True, text=True, check=True).stdout)
        megatron = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for token, groups in ours.items():
            assert groups == megatron.get_ranks(token), (world, tp, pp, cp, token)
