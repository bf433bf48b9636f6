"""The plugin's fairseq tasks: :mod:`.retrieval`, the retrieval tasks as language modelling."""

from kerple_fairseq.tasks import retrieval  # noqa: F401  (registration)
