"""SeqIO task and mixture registrations for ktx (importable as `ktx.tasks`)."""
from ktx.tasks import synthetic  # noqa: F401
from ktx.tasks import biomed, biomed_infusion, biomed_pairs, biomed_tagging  # noqa: F401
from ktx.tasks import config, glue, super_glue, cs224n, mixtures  # noqa: F401
from ktx.tasks import recsys  # noqa: F401
