"""Schedules: how draft and verify work is arranged in time (SSD's asynchronous speculation cache), apart from the
proposers, which say what is drafted."""
