"""The subcommands of ``kerple-analyze``, a module each: its options and what it does, declared as a
:class:`~kerple_fairseq.analysis.commands.shared.Command`; :mod:`.shared` holds what several share."""
