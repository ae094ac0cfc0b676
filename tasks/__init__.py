"""SeqIO task and mixture registrations for ktx (importable as `ktx.tasks`)."""
