"""How the runtime's ONNX Runtime threads wait between kernels (dspark.runtime.ort_backend.session_options)."""
from __future__ import annotations

from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.ort_backend import session_options


def test_threads_spin_while_a_graph_runs_and_stop_when_it_ends():
    spinning = session_options(2, spin=True)
    assert spinning.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    # a bundle's graphs take turns: a pool still spinning after its run would take a core from the next graph
    assert spinning.get_session_config_entry("session.force_spinning_stop") == "1"
    assert spinning.intra_op_num_threads == 2
    sleeping = session_options(2)  # the library's default: other busy threads may share the cores
    assert sleeping.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_spinning_or_not_decodes_the_same_tokens(tiny_bundle_v6):
    bundle = tiny_bundle_v6[3]
    prompts = [[1, 2, 3], [5, 4, 2, 3, 1, 1]]
    tokens = {}
    for spin in (None, True, None):
        with Runtime(bundle, spin=spin) as rt:
            sessions = [rt.backend.draft.session, rt.backend.heads.session]
            assert {s.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
                    for s in sessions} == {"1" if spin else "0"}
            results = rt.generate(prompts, DecodeOptions(max_tokens=12, policy="all"))
        tokens.setdefault(spin, []).append([r.token_ids for r in results])
    assert tokens[True][0] == tokens[None][0] == tokens[None][1]
    assert any(tokens[True][0])
