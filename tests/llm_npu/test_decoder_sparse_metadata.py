"""dal.export_decoder keeps dal.sparse_24 pointing at the file's initializers: the export renames every
weight (``lm.model...`` -> ``model...``), and the metadata's keys are renamed with them, so dal.npu
(which refuses a key that is no initializer) loads a 2:4 decoder. Oracle: the file's own initializer
names, and the codes in those initializers being 2 of every 4 nonzero along the input axis."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402

T = pytest.importorskip("transformers")


def test_prefill_file_of_a_2_of_4_llama_names_its_codes_and_loads_in_dal_npu(tmp_path):
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                             max_position_embeddings=128))
    root = os.path.dirname(os.path.dirname(os.path.abspath(dal.__file__)))
    with open(os.path.join(root, "recipes", "w4a8_int8_llm.yaml")) as fh:
        rec = yaml.safe_load(fh)
    for rule in rec["rules"]:  # the int4 linears (not lm_head) 2:4
        if rule.get("type") == "linear" and "position" not in rule:
            rule["sparsity"] = "2:4"
    ids = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    p = dal.prepare_qat(model, recipe=rec, hardware="a2000")
    dal.calibrate(p, ids)
    pre, _ = dal.export_decoder(p, str(tmp_path / "tiny"), prompt_len=8, cache_len=8)
    proto = onnx.load(pre)
    sparse = json.loads({m.key: m.value for m in proto.metadata_props}["dal.sparse_24"])
    inits = {i.name: i for i in proto.graph.initializer}
    assert len(sparse) == 7  # q, k, v, o, gate, up, down
    for name, axis in sparse.items():
        assert name in inits, name
        codes = np.moveaxis(numpy_helper.to_array(inits[name]).astype(np.int32), axis, -1)
        assert ((codes.reshape(-1, 4) != 0).sum(axis=1) <= 2).all(), name
    dal.npu.load(pre, threads=1)  # refuses a dal.sparse_24 key that is no initializer
