"""Measuring one configuration: in an isolated child process (`trial` on the parent's side,
`child` inside it), or without running it (`fake_step`). A measurement is plain data
(`measurement`), so the search and the profile can read it without torch."""
