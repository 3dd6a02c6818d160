-- One row that `/readyz` and the start-up check rewrite: the cheapest write that
-- proves the database takes commits.
CREATE TABLE store_probe (
    id BIGINT PRIMARY KEY CHECK (id = 1),
    at TEXT NOT NULL
);
