"""Test instruments the trainer attaches only when a ``debug.*`` key asks for them: the sample
log and injected non-finite losses (``debug``), the count of device-to-host synchronisations
(``hostsync``). Used by the tests and the GPU kit, never by a normal run."""
