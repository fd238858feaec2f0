"""Shared by the transformers-based e2e checks (hf_export_check.py, llama3_shapes_check.py)."""
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
