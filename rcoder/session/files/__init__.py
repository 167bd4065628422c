"""A project's files through the API (docs/files.md): the calls and their rules
(``project_files``), the blocking work they run in threads (``blocking``), and the uploads a
killed daemon left behind (``upload_journal``)."""
