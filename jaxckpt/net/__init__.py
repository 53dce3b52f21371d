"""The transport between processes: ``_wire`` seals and frames every request
and reply (agents, lighthouse, replica groups); ``_bulk`` moves snapshot bytes
between hosts on plain TCP streams, verified as they land. No JAX here."""
