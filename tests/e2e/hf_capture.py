"""Shared by the transformers-based e2e checks (hf_export_check.py, llama3_shapes_check.py, qwen3_check.py,
moe_check.py)."""
import io
import logging
import warnings


class Captured:
    """transformers' log records at WARNING and above, plus Python warnings, while active (captured, not
    printed: a check that fails shows them in its message). Also silences transformers' own handler
    and progress bars."""

    def __enter__(self):
        import transformers
        transformers.logging.disable_default_handler()
        transformers.logging.disable_progress_bar()
        self.buf = io.StringIO()
        self.handler = logging.StreamHandler(self.buf)
        self.handler.setLevel(logging.WARNING)
        self.logger = logging.getLogger("transformers")
        self.logger.addHandler(self.handler)
        self.catcher = warnings.catch_warnings(record=True)
        self.records = self.catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        import transformers
        self.catcher.__exit__(*exc)
        self.logger.removeHandler(self.handler)
        transformers.logging.enable_default_handler()
        return False

    @property
    def text(self):
        return self.buf.getvalue() + "\n".join(str(w.message) for w in self.records)


def load_checked(path):
    """transformers' AutoModelForCausalLM of directory `path` in float32, eval mode, asserting that
    transformers reported no missing, unexpected or mismatched tensor, no loading error, and printed
    no warning while loading."""
    import torch
    from transformers import AutoModelForCausalLM
    with Captured() as cap:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), f"{path}: transformers reports {k} = {info[k]}"
    assert not cap.text.strip(), f"{path}: transformers warned while loading:\n{cap.text}"
    return model.eval()
