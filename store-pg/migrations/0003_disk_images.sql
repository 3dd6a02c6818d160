-- Image family `disk`: whole-disk images written by pxed's deploy agent.
-- (PostgreSQL changes the CHECK constraint in place; SQLite rebuilds the table.)
ALTER TABLE images DROP CONSTRAINT images_family_check;
ALTER TABLE images ADD CONSTRAINT images_family_check
    CHECK (family IN ('kickstart', 'autoinstall', 'preseed', 'disk'));
