use serde::{Deserialize, Serialize};

use crate::ImageConfig;
use crate::{params, Backend, Db, Row, StateError};

/// The tag a name without one means.
pub const DEFAULT_TAG: &str = "default";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bTemplate {
    pub id: String,
    pub name: String,
    pub created_at: i64,
    /// The tenant that built it (`None`: an administrator's, which every
    /// tenant may start sandboxes from).
    pub tenant: Option<String>,
}

/// Where a build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }

    fn parse(s: &str) -> Result<BuildStatus, StateError> {
        Ok(match s {
            "waiting" => BuildStatus::Waiting,
            "building" => BuildStatus::Building,
            "ready" => BuildStatus::Ready,
            "error" => BuildStatus::Error,
            other => return Err(StateError::Damaged(format!("a template build's status is {other:?}"))),
        })
    }
}

/// One line of a build's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLogLine {
    /// Milliseconds since the epoch.
    pub at: i64,
    /// `info`, `warn`, `error` or `debug`.
    pub level: String,
    pub message: String,
    /// The step it belongs to (E2B counts them from 1; 0 is the base).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
}

/// Why a build failed: the message, and the step (E2B's numbering) where
/// one did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildFailure {
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TemplateBuild {
    pub id: String,
    pub template_id: String,
    pub status: BuildStatus,
    /// The tags it takes once ready.
    pub tags: Vec<String>,
    pub image: Option<String>,
    pub config: Option<ImageConfig>,
    pub reason: Option<BuildFailure>,
    /// Kept with the row once the build finished (while it runs, the
    /// gateway holds them).
    pub logs: Vec<BuildLogLine>,
    pub created_at: i64,
    pub finished_at: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateTag {
    pub template_id: String,
    pub tag: String,
    pub build_id: String,
    pub created_at: i64,
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("a template record serialises")
}

fn parsed<T: for<'a> Deserialize<'a>>(text: Option<String>, what: &str) -> Result<Option<T>, StateError> {
    text.map(|t| serde_json::from_str(&t).map_err(|e| StateError::Damaged(format!("a template build's {what}: {e}"))))
        .transpose()
}

/// Points `tags` of a template at `build_id`, replacing what they named.
fn point_tags(
    b: &mut dyn Backend,
    template_id: &str,
    build_id: &str,
    tags: &[String],
    at: i64,
) -> Result<(), StateError> {
    for tag in tags {
        b.execute(
            "DELETE FROM e2b_template_tags WHERE template_id = $1 AND tag = $2",
            params![template_id, tag],
        )?;
        b.execute(
            "INSERT INTO e2b_template_tags (template_id, tag, build_id, created_at) VALUES ($1, $2, $3, $4)",
            params![template_id, tag, build_id, at],
        )?;
    }
    Ok(())
}

fn template_row(r: &Row) -> Result<E2bTemplate, StateError> {
    Ok(E2bTemplate {
        id: r.get(0)?,
        name: r.get(1)?,
        created_at: r.get(2)?,
        tenant: r.get(3)?,
    })
}

/// The templates a connection acting for a tenant may see: its own and
/// the administrator's.
const VISIBLE: &str = "(CAST($2 AS TEXT) IS NULL OR tenant IS NULL OR tenant = $2)";

const BUILD_COLUMNS: &str = "id, template_id, status, tags, image, config, reason, logs, created_at, finished_at";

fn build_row(r: &Row) -> Result<TemplateBuild, StateError> {
    Ok(TemplateBuild {
        id: r.get(0)?,
        template_id: r.get(1)?,
        status: BuildStatus::parse(&r.get::<String>(2)?)?,
        tags: parsed(Some(r.get(3)?), "tags")?.unwrap_or_default(),
        image: r.get(4)?,
        config: parsed(r.get(5)?, "config")?,
        reason: parsed(r.get(6)?, "reason")?,
        logs: parsed(r.get(7)?, "logs")?.unwrap_or_default(),
        created_at: r.get(8)?,
        finished_at: r.get(9)?,
    })
}

impl Db {
    /// The template named `name`, made with `new_id` if there is none; and
    /// a new `waiting` build of it, in one transaction.
    pub fn start_e2b_template_build(
        &self,
        name: &str,
        new_id: &str,
        build_id: &str,
        tags: &[String],
        at: i64,
    ) -> Result<E2bTemplate, StateError> {
        // A tenant's template names are its own (stored qualified).
        let name = match self.acting_for() {
            Some(t) => crate::tenants::qualify(&t, name),
            None => name.to_string(),
        };
        let name = name.as_str();
        self.transaction(|b| {
            let found = b.query(
                "SELECT id, name, created_at, tenant FROM e2b_templates WHERE name = $1",
                params![name],
            )?;
            if let (Some(t), Some(r)) = (self.acting_for(), found.first()) {
                // A tenant builds only its own templates.
                if r.get::<Option<String>>(3)?.as_deref() != Some(t.as_str()) {
                    return Err(StateError::NameOfAnother(name.to_string()));
                }
            }
            let template = match found.first() {
                Some(r) => template_row(r)?,
                None => {
                    b.execute(
                        "INSERT INTO e2b_templates (id, name, created_at) VALUES ($1, $2, $3)",
                        params![new_id, name, at],
                    )?;
                    self.stamp(b, crate::tenants::Owned::E2bTemplate, new_id)?;
                    E2bTemplate {
                        id: new_id.to_string(),
                        name: name.to_string(),
                        created_at: at,
                        tenant: self.acting_for(),
                    }
                }
            };
            b.execute(
                &format!("INSERT INTO e2b_template_builds ({BUILD_COLUMNS}) VALUES ($1, $2, $3, $4, NULL, NULL, NULL, NULL, $5, NULL)"),
                params![build_id, &template.id, BuildStatus::Waiting.as_str(), json(&tags), at],
            )?;
            Ok(template)
        })
    }

    pub fn e2b_templates(&self) -> Result<Vec<E2bTemplate>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT id, name, created_at, tenant FROM e2b_templates
                 WHERE (CAST($1 AS TEXT) IS NULL OR tenant IS NULL OR tenant = $1) ORDER BY name",
                params![self.acting_for()],
            )?
            .iter()
            .map(template_row)
            .collect()
        })
    }

    /// The template with id or name `key`, if this connection's tenant
    /// may see it: its own first (by the name it gave, stored qualified),
    /// then the administrator's.
    pub fn e2b_template(&self, key: &str) -> Result<Option<E2bTemplate>, StateError> {
        let tenant = self.acting_for();
        let qualified = tenant
            .as_deref()
            .map_or_else(|| key.to_string(), |t| crate::tenants::qualify(t, key));
        let found: Vec<E2bTemplate> = self.with(|b| {
            b.query(
                &format!(
                    "SELECT id, name, created_at, tenant FROM e2b_templates
                     WHERE (id = $1 OR name = $1 OR name = $3) AND {VISIBLE}"
                ),
                params![key, &tenant, &qualified],
            )?
            .iter()
            .map(template_row)
            .collect::<Result<_, _>>()
        })?;
        let own = found.iter().position(|t| t.tenant.is_some() && t.tenant == tenant);
        Ok(match own {
            Some(i) => found.into_iter().nth(i),
            None => found.into_iter().next(),
        })
    }

    pub fn e2b_template_build(&self, id: &str) -> Result<Option<TemplateBuild>, StateError> {
        self.with(|b| {
            b.query(
                &format!("SELECT {BUILD_COLUMNS} FROM e2b_template_builds WHERE id = $1"),
                params![id],
            )?
            .first()
            .map(build_row)
            .transpose()
        })
    }

    /// The builds still `waiting` or `building`.
    pub fn unfinished_e2b_template_builds(&self) -> Result<Vec<TemplateBuild>, StateError> {
        self.with(|b| {
            b.query(
                &format!("SELECT {BUILD_COLUMNS} FROM e2b_template_builds WHERE status IN ('waiting', 'building')"),
                &[],
            )?
            .iter()
            .map(build_row)
            .collect()
        })
    }

    /// Moves a build from `waiting` to `building`; false if it was not
    /// waiting (already started, or finished).
    pub fn claim_e2b_template_build(&self, id: &str) -> Result<bool, StateError> {
        self.with(|b| {
            Ok(b.execute(
                "UPDATE e2b_template_builds SET status = 'building' WHERE id = $1 AND status = 'waiting'",
                params![id],
            )? > 0)
        })
    }

    /// Records a build's end: ready with its image and config (and its
    /// tags moved onto it, in the same transaction), or failed.
    pub fn finish_e2b_template_build(
        &self,
        build: &TemplateBuild,
        outcome: Result<(&str, &ImageConfig), &BuildFailure>,
        logs: &[BuildLogLine],
        at: i64,
    ) -> Result<(), StateError> {
        self.transaction(|b| {
            match outcome {
                Ok((image, config)) => {
                    b.execute(
                        "UPDATE e2b_template_builds SET status = 'ready', image = $2, config = $3, logs = $4, \
                         finished_at = $5 WHERE id = $1",
                        params![&build.id, image, json(config), json(&logs), at],
                    )?;
                    point_tags(b, &build.template_id, &build.id, &build.tags, at)?;
                }
                Err(reason) => {
                    b.execute(
                        "UPDATE e2b_template_builds SET status = 'error', reason = $2, logs = $3, finished_at = $4 \
                         WHERE id = $1",
                        params![&build.id, json(reason), json(&logs), at],
                    )?;
                }
            }
            Ok(())
        })
    }

    /// The tags of a template, by name.
    pub fn e2b_template_tags(&self, template_id: &str) -> Result<Vec<TemplateTag>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT template_id, tag, build_id, created_at FROM e2b_template_tags WHERE template_id = $1 ORDER BY tag",
                params![template_id],
            )?
            .iter()
            .map(|r| {
                Ok(TemplateTag {
                    template_id: r.get(0)?,
                    tag: r.get(1)?,
                    build_id: r.get(2)?,
                    created_at: r.get(3)?,
                })
            })
            .collect()
        })
    }

    /// Points `tags` of a template at `build_id` (replacing what they
    /// named), in one transaction.
    pub fn tag_e2b_template_build(
        &self,
        template_id: &str,
        build_id: &str,
        tags: &[String],
        at: i64,
    ) -> Result<(), StateError> {
        self.transaction(|b| point_tags(b, template_id, build_id, tags, at))
    }

    /// Removes `tags` of a template; how many were there.
    pub fn untag_e2b_template(&self, template_id: &str, tags: &[String]) -> Result<u64, StateError> {
        self.transaction(|b| {
            let mut removed = 0;
            for tag in tags {
                removed += b.execute(
                    "DELETE FROM e2b_template_tags WHERE template_id = $1 AND tag = $2",
                    params![template_id, tag],
                )?;
            }
            Ok(removed)
        })
    }

    /// Forgets a template, its builds and tags; the images its builds made
    /// (returned) are the caller's to remove.
    pub fn delete_e2b_template(&self, template_id: &str) -> Result<Vec<String>, StateError> {
        self.transaction(|b| {
            let images = b
                .query(
                    "SELECT image FROM e2b_template_builds WHERE template_id = $1 AND image IS NOT NULL",
                    params![template_id],
                )?
                .iter()
                .map(|r| r.get::<String>(0))
                .collect::<Result<Vec<_>, _>>()?;
            b.execute(
                "DELETE FROM e2b_template_tags WHERE template_id = $1",
                params![template_id],
            )?;
            b.execute(
                "DELETE FROM e2b_template_builds WHERE template_id = $1",
                params![template_id],
            )?;
            b.execute("DELETE FROM e2b_templates WHERE id = $1", params![template_id])?;
            Ok(images)
        })
    }
}
