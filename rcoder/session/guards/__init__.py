"""The bounds a running turn is kept under: a project's size on disk (``disk``), the money its
agents spend (``spend``) and the usage they report, stored as it comes (``usage_writer``)."""
